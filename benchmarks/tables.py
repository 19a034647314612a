"""The generated tables of docs/benchmarks.md, rebuilt from the benchmarks' own output.

Each generated table sits between ``<!-- tables.py: NAME -->`` and ``<!-- /tables.py -->`` and
says the machine and the commands it came from. A spec below names the commands and how their
JSON becomes the table:

    .venv/bin/python benchmarks/tables.py --list                  # the specs and their commands
    .venv/bin/python benchmarks/tables.py --check                 # cheap; no timing
    .venv/bin/python benchmarks/tables.py --write                 # every table (measures here)
    .venv/bin/python benchmarks/tables.py --write host-all-reduce cuda-ipc-fused

--check fails when a marker names no spec or a spec has no marker, and regenerates the tables
whose source is deterministic (the cost model's, and the summary, derived from the other
tables), printing a diff of any that differ. Measured tables change only by --write, on the
machine they then describe.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"^<!-- tables\.py: ([\w-]+) -->\n(.*?)^<!-- /tables\.py -->$", re.S | re.M)
MODEL = "benchmarks/cost_model_report.py"
MODEL_12K = (f"{MODEL} --bytes 12288",)  # 12 KiB: one decode row of 6144 bf16
HOST = "pcie-allreduce bench --transport host_shm --dtype bf16"
SIZES = "--min-bytes 3K --max-bytes 768K"  # 3 KiB .. 768 KiB: a quarter to 64 rows of 6144 bf16
NA = "—"


class Spec(NamedTuple):
    runs: tuple[str, ...]  # each a command: "pcie-allreduce ARGS" or "benchmarks/SCRIPT.py ARGS"
    render: Callable[[list[Any]], list[str]]  # the runs' JSON, in order -> the table's lines
    modelled: bool = False  # deterministic: --check regenerates it


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % (scale // 4) == 0:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _bytes(text: str) -> int:
    number, _, unit = text.partition(" ")
    return int(float(number) * {"MiB": 1 << 20, "KiB": 1 << 10}.get(unit, 1))


def _us(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---:" if h.endswith(("µs", "×", "size", "rows")) else "---" for h in header]
    return [_line(header), _line(align), *map(_line, rows)]


# ------------------------------------------------------------------ measured (host_shm)


def _per_world(columns: list[tuple[str, Callable[[dict[str, Any]], str]]], tactic: str = ""):
    """A table by message size with ``columns`` for each run's world side by side, and the
    first run's ``tactic`` (the row's key naming what ran) last."""

    def render(results: list[Any]) -> list[str]:
        header = ["size"]
        by_world = []
        for res in results:
            header += [f"w{res['world']} {name}" for name, _ in columns]
            by_world.append({row["size"]: row for row in res["rows"]})
        header += [f"w{results[0]['world']} {tactic}"] if tactic else []
        rows = []
        for size in sorted(set().union(*by_world)):
            cells = [_size(size)]
            for rows_of in by_world:
                row = rows_of.get(size)
                cells += [fn(row) if row else NA for _, fn in columns]
            first = by_world[0].get(size)
            cells += [f"`{first[tactic]}`" if first else NA] if tactic else []
            rows.append(cells)
        return _table(header, rows)

    return render


_FUSED = [
    ("rows", lambda r: f"{r['rows']} × {r['hidden']}"),
    ("fused µs", lambda r: _us(r["fused_us"])),
    ("plain all-reduce µs", lambda r: _us(r["plain_us"])),
    ("unfused µs", lambda r: _us(r["unfused_us"])),
    ("gloo + torch µs", lambda r: _us(r["fallback_us"])),
    ("fused / plain ×", lambda r: f"{r['fused_over_plain']:.2f}"),
    ("unfused / fused ×", lambda r: f"{r['unfused_over_fused']:.2f}"),
    ("fallback / fused ×", lambda r: f"{r['fallback_over_fused']:.0f}"),
]
_ALL_REDUCE = [
    ("ours µs", lambda r: _us(r["time_us"])),
    ("gloo µs", lambda r: _us(r["fallback_us"])),
    ("gloo / ours ×", lambda r: f"{r['speedup']:.0f}"),
]
_COLLECTIVE = [
    ("ours µs", lambda r: _us(r["time_us"])),
    ("our all-reduce µs", lambda r: _us(r["all_reduce_us"])),
    ("gloo µs", lambda r: _us(r["fallback_us"])),
    ("ours / all-reduce ×", lambda r: f"{r['over_all_reduce']:.2f}"),
    ("gloo / ours ×", lambda r: f"{r['speedup']:.0f}"),
]

# ------------------------------------------------------------------ modelled (GPU targets)


def _on(transport: str, render: Callable[[list[Any]], list[str]]):
    """``render`` over the targets of one transport only."""

    def on(results: list[Any]) -> list[str]:
        return render(
            [
                {**r, "targets": [t for t in r["targets"] if t["transport"] == transport]}
                for r in results
            ]
        )

    return on


def _model_all_reduce(results: list[Any]) -> list[str]:
    rows = []
    for t in results[0]["targets"]:
        for i, tac in enumerate(t["tactics"][:3]):
            now = f"{tac['us']['current']:.2f} ({tac['rt']['current']})"
            large = (
                f"{tac['us']['large-message kernels']:.2f} ({tac['rt']['large-message kernels']})"
            )
            rows.append([t["name"] if i == 0 else "", f"`{tac['tactic']}`", now, large])
    header = ["target", "tactic", "modelled µs", "on the large-message kernels µs"]
    return _table(header, rows)


def _model_fused(results: list[Any]) -> list[str]:
    rows = []
    for t in results[0]["targets"]:
        f = t["fused"]
        added = "; ".join(re.sub(r"^rank \d+ step \d+: | \(local \w+\)", "", a) for a in f["added"])
        plain, fused = f"{f['plain_us']:.2f} ({f['plain_rt']})", f"{f['us']:.2f} ({f['rt']})"
        rows.append([t["name"], f"`{f['tactic']}`", plain, fused, added])
    return _table(["target", "tactic", "plain µs", "fused µs", "added, all local"], rows)


def _model_collectives(results: list[Any]) -> list[str]:
    header = ["target"] + [f"{_size(r['bytes'])}: RS / AG / AR µs" for r in results]
    rows = []
    for i, t in enumerate(results[0]["targets"]):
        cells = [t["name"]]
        for res in results:
            c = {k: v["us"] for k, v in res["targets"][i]["collectives"].items()}
            rs, ag, ar = c["reduce_scatter"], c["all_gather"], c["all_reduce"]
            cells.append(f"{rs:.2f} / {ag:.2f} / {ar:.2f} ({rs / ar:.2f}×, {ag / ar:.2f}×)")
        rows.append(cells)
    return _table(header, rows)


SPECS: dict[str, Spec] = {
    "host-all-reduce": Spec(
        tuple(f"{HOST} --world {w} {SIZES}" for w in (2, 4)), _per_world(_ALL_REDUCE, "tactic")
    ),
    "host-fused": Spec(
        (f"{HOST} --world 2 --fused --hidden 6144 --min-bytes 12K --max-bytes 768K",),
        _per_world(_FUSED, "path"),
    ),
    "host-reduce-scatter": Spec(
        tuple(f"{HOST} --world {w} --collective reduce_scatter {SIZES}" for w in (2, 4)),
        _per_world(_COLLECTIVE),
    ),
    "host-all-gather": Spec(
        tuple(f"{HOST} --world {w} --collective all_gather {SIZES}" for w in (2, 4)),
        _per_world(_COLLECTIVE),
    ),
}
GPU = ("cuda_ipc", "cuda_host")
for _tr in GPU:
    _name = _tr.replace("_", "-")
    SPECS[f"{_name}-all-reduce"] = Spec(MODEL_12K, _on(_tr, _model_all_reduce), modelled=True)
    SPECS[f"{_name}-fused"] = Spec(MODEL_12K, _on(_tr, _model_fused), modelled=True)
    SPECS[f"{_name}-collectives"] = Spec(
        tuple(f"{MODEL} --bytes {n}" for n in (12288, 65536, 1 << 20)),
        _on(_tr, _model_collectives),
        modelled=True,
    )
SUMMARY = "summary"  # derived from the other blocks of the document, not from a run

# ------------------------------------------------------------------ running and the document


def shown(run: str) -> str:
    """The command as a user types it (docs/benchmarks.md, "Reproduce")."""
    cli = run.startswith("pcie-allreduce ")
    return (".venv/bin/" if cli else ".venv/bin/python ") + run + " --json FILE"


@functools.cache
def _execute(run: str, quiet: bool) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        program, *args = run.split()
        head = ["-m", "pcie_allreduce"] if program == "pcie-allreduce" else [str(ROOT / program)]
        argv = [sys.executable, *head, *args, "--json", out]
        if not quiet:
            print(f"# tables.py: {shown(run)}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, cwd=ROOT, capture_output=quiet, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{shown(run)} failed (exit {done.returncode}):\n{done.stderr}")
        with open(out) as f:
            return json.load(f)


def _machine() -> str:
    import torch

    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (
        f"{cpu.group(1) if cpu else platform.machine()}, {os.cpu_count()} cores, {gib:.0f} GiB, "
        f"{gpus or 'no'} GPU, torch {torch.__version__}, {datetime.date.today().isoformat()}"
    )


def generate(name: str, quiet: bool = False) -> str:
    spec = SPECS[name]
    results = [_execute(run, quiet) for run in spec.runs]
    commands = "\n".join(f"    {shown(run)}" for run in spec.runs)
    if spec.modelled:
        origin = "*Modelled*, not measured (the cost model, constants in `LatencyModel`, "
        origin += "csrc/plan/cost_model.h; no GPU involved). Command:"
    else:
        origin = f"*Measured* on {_machine()}. Commands:"
    return "\n".join([origin, "", commands, "", *spec.render(results), ""])


def _cells(doc: str, name: str) -> list[dict[str, str]]:
    """The rows of block ``name``'s table, by header (bold and code marks dropped)."""
    body = dict(BLOCK.findall(doc))[name]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    split = [[c.strip().strip("*`") for c in ln.strip("|").split("|")] for ln in lines]
    return [dict(zip(split[0], row)) for row in split[2:]]


def summary(doc: str) -> str:
    """One row per operation: the host_shm number at the first measured size from 12 KiB up
    beside gloo's, and the modelled GPU numbers at 12 KiB, taken from the other tables."""
    model: dict[str, dict[str, str]] = {}  # target -> operation -> modelled µs
    for tr in (t.replace("_", "-") for t in GPU):
        for r in _cells(doc, f"{tr}-all-reduce"):
            model.setdefault(r["target"], {}).setdefault("all-reduce", r["modelled µs"])
        for r in _cells(doc, f"{tr}-fused"):
            model[r["target"]]["fused"] = r["fused µs"]
        for r in _cells(doc, f"{tr}-collectives"):
            rs, ag, _ = r["12 KiB: RS / AG / AR µs"].split(" / ")
            model[r["target"]].update({"reduce-scatter": rs, "all-gather": ag})
    model.pop("", None)  # the rows of a target's runners-up
    ops = [  # operation, its host table, its columns there, its key in `model`
        ("all-reduce", "host-all-reduce", "ours", "gloo", "all-reduce"),
        ("all-reduce + add + RMSNorm", "host-fused", "fused", "gloo + torch", "fused"),
        ("reduce-scatter", "host-reduce-scatter", "ours", "gloo", "reduce-scatter"),
        ("all-gather", "host-all-gather", "ours", "gloo", "all-gather"),
    ]
    rows = []
    for op, table, ours, gloo, key in ops:
        row = next(r for r in _cells(doc, table) if _bytes(r["size"]) >= 12288)
        host = [row["size"], row[f"w2 {ours} µs"], row[f"w2 {gloo} µs"]]
        rows.append([op, *host, *(m[key].split()[0] for m in model.values())])
    header = ["operation", "host_shm w2: size", "ours µs", "gloo µs"]
    header += [f"{t}, 12 KiB: modelled µs" for t in model]
    return "\n".join(_table(header, rows)) + "\n"


def _replace(doc: str, name: str, body: str) -> str:
    marker = f"\n<!-- tables.py: {name} -->\n"
    start = doc.index(marker) + len(marker)
    return doc[:start] + body + doc[doc.index("\n<!-- /tables.py -->", start - 1) + 1 :]


def check(doc: str) -> list[str]:
    """Problems: markers without a spec and specs without a marker, then a diff of every
    deterministic table that differs from what its source gives now."""
    found = [name for name, _ in BLOCK.findall(doc)]
    known = [*SPECS, SUMMARY]
    problems = [f"marker names no spec: {n}" for n in found if n not in known]
    problems += [f"spec has no marker in the document: {n}" for n in known if n not in found]
    problems += [f"marker appears twice: {n}" for n in set(found) if found.count(n) > 1]
    opened = re.findall(r"^<!-- tables\.py: .*-->$", doc, re.M)
    if len(opened) != len(re.findall(r"^<!-- /tables\.py -->$", doc, re.M)) or problems:
        return problems or ["unbalanced markers"]
    want = doc
    for name, spec in SPECS.items():
        if spec.modelled:
            want = _replace(want, name, generate(name, quiet=True))
    want = _replace(want, SUMMARY, summary(want))
    if want != doc:
        diff = difflib.unified_diff(
            doc.splitlines(), want.splitlines(), "doc", "regenerated", lineterm=""
        )
        problems.append("deterministic tables differ:\n" + "\n".join(diff))
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="markers and modelled tables")
    mode.add_argument(
        "--write",
        nargs="*",
        metavar="NAME",
        help="rerun these tables' benchmarks (default: all) and rewrite them; names: "
        + ", ".join(SPECS),
    )
    mode.add_argument("--list", action="store_true", help="the specs and their commands")
    p.add_argument("--doc", type=Path, default=DOC, help="the document (default: %(default)s)")
    return p


def main() -> int:
    args = build_parser().parse_args()
    doc = args.doc.read_text()
    if args.list:
        for name, spec in SPECS.items():
            print(f"{name} ({'modelled' if spec.modelled else 'measured'}):")
            print("\n".join(f"    {shown(run)}" for run in spec.runs))
        print(f"{SUMMARY} (derived from the tables above)")
        return 0
    if args.check:
        problems = check(doc)
        print("\n".join(problems) or f"{args.doc}: every table matches its spec")
        return 1 if problems else 0
    unknown = [name for name in args.write if name not in SPECS]
    if unknown:
        print(f"tables.py: no table named {', '.join(unknown)}", file=sys.stderr)
        return 2
    for name in args.write or list(SPECS):
        doc = _replace(doc, name, generate(name))
    args.doc.write_text(_replace(doc, SUMMARY, summary(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
