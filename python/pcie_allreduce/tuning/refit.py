"""Refit the cost model's constants (csrc/plan/cost_model.h, ``LatencyModel``) from a GPU run.

Reads the JSON lines ``pcie_gpu_microbench`` (tests/gpu/microbench.cu) appends to
``$PCIE_GPU_JSONL`` (tests/gpu/quick.sh keeps them as ``$OUT/microbench.jsonl``). Lines of other
programs, such as quick.sh's per-step records, are skipped and counted; a line that is not a
JSON object, or a microbenchmark record without the fields its bench writes, is an error naming
its line. Prints, and with ``--json FILE`` also writes as JSON:

- every constant: its value and where it comes from (``measured``: the device, the date and the
  bench; otherwise ``published`` or ``guess``, from PROVENANCE below);
- the seed's GPU rows re-derived with the fitted constants (tuning/model.py) against today's:
  which size ranges change tactic, and the row diff to paste into csrc/plan/tuning_table.cc;
- the modelled 12 KiB all-reduce of cost_model_report.py's targets (TP2 and TP8 over P2P, and
  cuda_host) before and after, as markdown.

It writes no other file: benchmarks/tables.py rebuilds docs/benchmarks.md's modelled tables by
running cost_model_report.py, which always models with the compiled constants, so those tables
follow once the fitted values are in cost_model.h.

One GPU measures five constants: ``launch_us`` (graph_launch), ``local_load_us`` and
``host_read_us`` (flag_polls, one flag polled serially, in device and in pinned host memory),
``fence_after_local_writes_us`` and ``fence_after_peer_writes_us`` (system_fence after writes to
device and to host memory; the latter is exactly cuda_host's case and stands in for P2P writes).
The others need a second GPU or a second socket (UNMEASURED).

    python -m pcie_allreduce.tuning.refit RESULTS.jsonl [--json FILE] [--device NAME]
        [--date YYYY-MM-DD] [--launch {pdl,plain}]
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..native import _C
from . import model

PROGRAM = "microbench"
PREDICTION_BYTES = 12288  # one decode row of 6144 bf16
FENCE_CTAS = 16  # the flag rows' launch shape (model.launch_shape): CTAs that fence side by side
TARGETS = (  # benchmarks/cost_model_report.py's, by the same names
    ("world 2, P2P", [0, 0], "cuda_ipc"),
    ("world 8 (4+4), P2P", [0, 0, 0, 0, 1, 1, 1, 1], "cuda_ipc"),
    ("world 2, cuda_host", [0, 0], "cuda_host"),
    ("world 4, cuda_host", [0] * 4, "cuda_host"),
)

# Where each default of LatencyModel comes from (cost_model.h's comments, docs/benchmarks.md's
# "The cost model"): (source, what it is). Every field needs one (a test holds them equal).
PROVENANCE: dict[str, tuple[str, str]] = {
    "launch_us": ("published", "a kernel node of a CUDA graph, about 0.6 µs (eager: about 6)"),
    "local_load_us": ("guess", "a load or poll of this GPU's own L2"),
    "posted_write_us": ("published", "a store issued to visible in a peer, 0.36-0.45 µs"),
    "posted_write_cross_us": ("published", "the same across the socket link, 0.44 µs"),
    "peer_read_us": ("published", "a load of a peer's memory under load, 2.1-2.3 µs at 4 GPUs"),
    "peer_read_cross_us": ("guess", "the same across sockets (not published apart)"),
    "host_read_us": ("guess", "a load or poll of pinned host DRAM"),
    "host_write_us": ("guess", "a store to host DRAM until another GPU can read it"),
    "fence_after_peer_writes_us": ("guess", "fence.sc.sys with writes out on the fabric"),
    "fence_after_local_writes_us": ("guess", "fence.sc.sys with only local writes pending"),
    "gpu_link_gbps": ("published", "one GPU's stores to one peer, 44.8 GB/s"),
    "gpu_link_fanout_gbps": ("published", "stores to several peers in one stage, 25.4 GB/s"),
    "socket_link_gbps": (
        "published",
        "one rank's flow across the socket link, 23.75 GB/s (FlashInfer PR #4870, per flow)",
    ),
}

# Why no single-GPU record gives the others.
UNMEASURED = {
    "posted_write_us": "needs two GPUs with P2P",
    "posted_write_cross_us": "needs two GPUs on two sockets",
    "peer_read_us": "needs two GPUs with P2P",
    "peer_read_cross_us": "needs two GPUs on two sockets",
    "host_write_us": "no bench times a store to host memory until another GPU sees it",
    "gpu_link_gbps": "needs two GPUs with P2P",
    "gpu_link_fanout_gbps": "needs three or more GPUs with P2P",
    "socket_link_gbps": "needs GPUs on two sockets",
}

# The fields each bench that gives a constant writes (microbench.cu's record() calls).
FIELDS: dict[str, dict[str, type]] = {
    "system_fence": {"memory": str, "ctas": int, "no_fence_ns": int, "fence_ns": int},
    "flag_polls": {"memory": str, "flags": int, "serial_ns": int, "parallel_ns": int},
    "graph_launch": {"pdl": bool, "us": float},
}
# Benches microbench.cu writes that give no constant, and why.
NO_CONSTANT = {
    "copy_allreduce": "the pinned-copy all-reduce cuda_host must beat, not a model constant",
    "copy_round_trip": "cudaMemcpyAsync + sync, host-clocked: the copy baseline's parts",
    "idle_sync": "a stream sync's floor, host-clocked: the copy baseline's parts",
}

Record = dict[str, Any]


class RefitError(ValueError):
    """A line that cannot be read, or records that cannot be refitted (several devices)."""


@dataclass(frozen=True)
class Fit:
    """One constant from one bench: the records that measure it and each one's value in µs."""

    constant: str
    bench: str
    match: dict[str, Any]  # fields a record must have these values of
    us: Callable[[Record], float]
    pick: Callable[[list[Record]], list[Record]] = lambda rs: rs  # of the matches, the ones used


def _nearest_ctas(records: list[Record]) -> list[Record]:
    best = min((r["ctas"] for r in records), key=lambda c: abs(math.log2(c / FENCE_CTAS)))
    return [r for r in records if r["ctas"] == best]


def _launch(pdl: bool) -> Callable[[list[Record]], list[Record]]:
    # The executor launches with PDL where the GPU allows it (Options::pdl); without such a
    # record (before sm_90) the plain one is the launch the executor gets.
    return lambda rs: [r for r in rs if r["pdl"] == pdl] or rs


def _fence_us(r: Record) -> float:
    return float(r["fence_ns"] - r["no_fence_ns"]) / 1e3


def fits(launch: str = "pdl") -> list[Fit]:
    def poll(r: Record) -> float:
        return float(r["serial_ns"]) / 1e3

    host = {"memory": "host(PCIe)"}
    return [
        Fit("launch_us", "graph_launch", {}, lambda r: float(r["us"]), _launch(launch == "pdl")),
        Fit("local_load_us", "flag_polls", {"memory": "device", "flags": 1}, poll),
        Fit("host_read_us", "flag_polls", {**host, "flags": 1}, poll),
        Fit(
            "fence_after_local_writes_us",
            "system_fence",
            {"memory": "device"},
            _fence_us,
            _nearest_ctas,
        ),
        Fit("fence_after_peer_writes_us", "system_fence", host, _fence_us, _nearest_ctas),
    ]


@dataclass
class Records:
    """A file's microbenchmark records by bench, and what was skipped."""

    by_bench: dict[str, list[Record]] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)  # program -> lines
    devices: set[str] = field(default_factory=set)


def _is(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def _check(where: str, rec: Record) -> None:
    """Raises RefitError unless ``rec`` has the fields its bench writes, of their types."""
    bench = rec.get("bench")
    wanted = {"device": str, "bench": str, **FIELDS.get(str(bench), {})}
    for name, kind in wanted.items():
        if not _is(rec.get(name), kind):
            raise RefitError(f"{where}: {bench} record: {name!r} is not a {kind.__name__}")


def read_records(path: str | Path, device: str | None = None) -> Records:
    out = Records()
    with open(path) as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise RefitError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise RefitError(f"{path}:{n}: not a JSON object")
            if rec.get("program") != PROGRAM:
                out.skipped[str(rec.get("program", "(no program: quick.sh steps)"))] += 1
                continue
            _check(f"{path}:{n}", rec)
            if device is not None and rec["device"] != device:
                out.skipped[f"{PROGRAM} on {rec['device']}"] += 1
                continue
            out.devices.add(rec["device"])
            out.by_bench.setdefault(rec["bench"], []).append(rec)
    if len(out.devices) > 1:
        names = ", ".join(sorted(out.devices))
        raise RefitError(f"{path}: records of several devices ({names}); pick one with --device")
    if device is not None and not out.devices:
        raise RefitError(f"{path}: no {PROGRAM} record of device {device!r}")
    return out


@dataclass
class Refit:
    constants: dict[str, float]  # every LatencyModel field, fitted or default
    provenance: dict[str, dict[str, Any]]
    records: Records
    warnings: list[str] = field(default_factory=list)

    @property
    def fitted(self) -> dict[str, float]:
        return {
            k: v for k, v in self.constants.items() if self.provenance[k]["source"] == "measured"
        }

    @property
    def unknown_benches(self) -> dict[str, int]:
        known = {*FIELDS, *NO_CONSTANT}
        return {b: len(rs) for b, rs in sorted(self.records.by_bench.items()) if b not in known}


def default_provenance() -> dict[str, dict[str, Any]]:
    return {
        name: {"value": value, "source": PROVENANCE[name][0], "text": PROVENANCE[name][1]}
        for name, value in _C.latency_model().items()
    }


def _word(value: Any) -> str:
    """A field's value as microbench.cu writes it (``true``, ``host(PCIe)``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fit(records: Records, date: str, launch: str = "pdl") -> Refit:
    """The constants ``records`` measure (the median of every record a fit uses), the others
    at their defaults."""
    provenance = default_provenance()
    warnings = []
    device = next(iter(records.devices), "")
    for f in fits(launch):
        matched = [
            r
            for r in records.by_bench.get(f.bench, [])
            if all(r[k] == v for k, v in f.match.items())
        ]
        if not matched:
            continue
        used = f.pick(matched)
        value = statistics.median(f.us(r) for r in used)
        keys = {k: used[0][k] for k in ("memory", "flags", "ctas", "pdl") if k in used[0]}
        bench = f.bench + "".join(f" {k}={_word(v)}" for k, v in keys.items())
        if value <= 0:
            warnings.append(f"{f.constant}: {bench} gives {value:.3f} µs; kept the default")
            continue
        provenance[f.constant] = {
            "value": round(value, 4),
            "source": "measured",
            "device": device,
            "date": date,
            "bench": f"{bench} (median of {len(used)})",
        }
    constants = {k: float(p["value"]) for k, p in provenance.items()}
    return Refit(constants, provenance, records, warnings)


def refit(
    path: str | Path, *, device: str | None = None, date: str | None = None, launch: str = "pdl"
) -> Refit:
    """Read and fit ``path``; ``date`` defaults to the file's modification date (microbench.cu's
    records carry none)."""
    if date is None:
        mtime = Path(path).stat().st_mtime
        date = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).date().isoformat()
    return fit(read_records(path, device), date, launch)


def predictions(constants: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """The best tactic of each target at 12 KiB under ``constants`` (None: the defaults)."""
    out = []
    for name, island_of, transport in TARGETS:
        t = model.rank_tactics(len(island_of), island_of, transport, PREDICTION_BYTES, constants)[0]
        staged = "staged" if t["staged"] else "unstaged"
        tactic = f"{t['algorithm']}/{t['direction']}/{staged}/{t['protocol']}"
        us, rt = round(t["modelled_us"], 4), t["serial_round_trips"]
        out.append({"target": name, "tactic": tactic, "us": us, "rt": rt})
    return out


def seed_changes(before: Sequence[str], after: Sequence[str]) -> list[dict[str, Any]]:
    """Size ranges whose tactic differs between two sets of seed rows: one entry per run of
    adjacent buckets with the same change, per (topology, world, collective)."""

    def by_bucket(rows: Sequence[str]) -> dict[tuple[str, str, str, int], str]:
        out = {}
        for row in rows:
            key, world, _, lo, hi, *tactic = row.split(",")
            collective, _, algorithm = tactic[0].rpartition(":")
            for b_lo, _, _ in model.buckets():
                if int(lo) <= b_lo and (hi == "*" or b_lo < int(hi)):
                    family = (key, world, collective or "all_reduce", b_lo)
                    out[family] = ",".join([algorithm, *tactic[1:]])
        return out

    old, new = by_bucket(before), by_bucket(after)
    edges = {lo: hi for lo, hi, _ in model.buckets()}
    changes: list[dict[str, Any]] = []
    for (key, world, collective, lo), was in old.items():  # in table order
        now = new.get((key, world, collective, lo))
        if was == now:
            continue
        c = {"topology": key, "world": world, "collective": collective, "min_bytes": lo}
        c.update({"max_bytes": edges[lo], "before": was, "after": now})
        last = changes[-1] if changes else {}
        if {**last, "min_bytes": lo, "max_bytes": edges[lo]} == c and last["max_bytes"] == lo:
            last["max_bytes"] = edges[lo]  # the run goes on into this bucket
        else:
            changes.append(c)
    return changes


def report(result: Refit) -> dict[str, Any]:
    """Everything the refit found, as JSON."""
    before = model.derive_seed_rows()
    after = model.derive_seed_rows(result.fitted)
    rec = result.records
    return {
        "device": next(iter(rec.devices), None),
        "records": {
            "used": {b: len(rs) for b, rs in sorted(rec.by_bench.items())},
            "skipped": dict(rec.skipped),
            "unknown_benches": result.unknown_benches,
            "no_constant": {b: NO_CONSTANT[b] for b in sorted(rec.by_bench) if b in NO_CONSTANT},
        },
        "constants": result.provenance,
        "unmeasured": UNMEASURED,
        "warnings": result.warnings,
        "predictions": {
            "bytes": PREDICTION_BYTES,
            "before": predictions(),
            "after": predictions(result.fitted),
        },
        "seed": {
            "changes": seed_changes(before, after),
            "diff": list(difflib.unified_diff(before, after, "seed", "refit", lineterm="", n=0)),
            "rows": after,
        },
    }


def _range(lo: int, hi: int | None) -> str:
    return f"[{lo}, {'*' if hi is None else hi})"


def render(rep: dict[str, Any]) -> str:
    device = rep["device"]
    lines = [f"device: {'none (no microbench record)' if device is None else repr(device)}"]
    recs = rep["records"]
    lines.append(f"records used: {recs['used'] or 'none'}; skipped: {recs['skipped'] or 'none'}")
    for bench, n in recs["unknown_benches"].items():
        lines.append(f"unknown bench {bench!r}: {n} records, no constant")
    lines += [f"bench {b!r}: {why}" for b, why in recs["no_constant"].items()]
    lines += [f"warning: {w}" for w in rep["warnings"]]
    lines += ["", "| constant | value | source |", "|---|---:|---|"]
    for name, p in rep["constants"].items():
        if p["source"] == "measured":
            source = f"measured: {p['device']}, {p['date']}, {p['bench']}"
        else:
            why = f"; {UNMEASURED[name]}" if name in UNMEASURED else ""
            source = f"{p['source']}: {p['text']}{why}"
        lines.append(f"| `{name}` | {p['value']:g} | {source} |")
    pred = rep["predictions"]
    lines += ["", f"Modelled all-reduce, {pred['bytes']} bytes (best tactic, µs (round trips)):"]
    lines += ["", "| target | before | µs | after | µs |", "|---|---|---:|---|---:|"]
    for b, a in zip(pred["before"], pred["after"]):
        lines.append(
            f"| {b['target']} | `{b['tactic']}` | {b['us']:.2f} ({b['rt']}) "
            f"| `{a['tactic']}` | {a['us']:.2f} ({a['rt']}) |"
        )
    changes = rep["seed"]["changes"]
    lines += ["", f"Seed GPU rows: {len(changes) or 'no'} size ranges change tactic"]
    for c in changes:
        span = _range(c["min_bytes"], c["max_bytes"])
        where = f"{c['topology']},{c['world']} {c['collective']} {span}"
        lines.append(f"  {where}: {c['before']} -> {c['after']}")
    if rep["seed"]["diff"]:
        lines += ["", "Rows to paste into csrc/plan/tuning_table.cc (diff):", *rep["seed"]["diff"]]
    lines += [
        "",
        "docs/benchmarks.md's modelled tables are not rewritten: benchmarks/tables.py runs",
        "cost_model_report.py, which models with the compiled constants; the markdown above is",
        "the comparison, and the tables follow once the fitted values are in cost_model.h.",
    ]
    return "\n".join(lines)


def _iso_date(text: str) -> str:
    try:
        return datetime.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pcie_allreduce.tuning.refit", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("results", type=Path, help="microbench JSONL ($PCIE_GPU_JSONL)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the report as JSON")
    p.add_argument("--device", help="use this device's records (needed when there are several)")
    p.add_argument(
        "--date",
        type=_iso_date,
        help="the run's date, YYYY-MM-DD (default: the file's modification date)",
    )
    p.add_argument(
        "--launch",
        choices=("pdl", "plain"),
        default="pdl",
        help="which graph_launch record gives launch_us (default: pdl, as the executor launches)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = refit(args.results, device=args.device, date=args.date, launch=args.launch)
    except (OSError, RefitError) as e:
        print(f"refit: {e}", file=sys.stderr)
        return 2
    rep = report(result)
    print(render(rep))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
