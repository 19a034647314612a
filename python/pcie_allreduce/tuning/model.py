"""Table rows from the cost model (csrc/plan/cost_model.h): for each size bucket, the tactic
whose modelled time of one call is lowest. The embedded seed's GPU rows are these rows (a test
holds them equal); after a refit of the model's constants, print the new ones with

    python -m pcie_allreduce.tuning.model

and paste them into csrc/plan/tuning_table.cc. They stay estimates until a tune on a real PCIe
host measures them (docs/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..native import _C
from ..plan import FLAG_IN_DATA

# Buckets [2^k, 2^(k+1)) from 2 KiB (the first one starts at 0), each judged at its geometric
# middle; the last one is open.
FIRST_EDGE = 2048
LAST_EDGE = 4 << 20
# LL slots hold at most this much payload (plan::kMaxLLPayloadBytes).
MAX_LL_BYTES = 256 * 1024


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def gpu_families() -> list[tuple[str, str, list[int], str]]:
    """The seed's GPU rows, in table order: (topology key, world column, the island map they are
    judged on, transport). Worlds 2 and 4 have their own rows; "*" is judged at world 8, the
    dearest, and holds for the worlds between."""

    def halves(w: int) -> list[int]:
        return [0 if r < w // 2 else 1 for r in range(w)]

    return [
        ("cuda_host", "2", [0] * 2, "cuda_host"),
        ("cuda_host", "4", [0] * 4, "cuda_host"),
        ("cuda_host", "*", [0] * 8, "cuda_host"),
        ("islands-2x4", "8", halves(8), "cuda_ipc"),
        ("islands-2x3", "6", halves(6), "cuda_ipc"),
        ("islands-2x2", "4", halves(4), "cuda_ipc"),
        ("*", "2", [0] * 2, "cuda_ipc"),
        ("*", "4", [0] * 4, "cuda_ipc"),
        ("*", "*", [0] * 8, "cuda_ipc"),
    ]


def launch_shape(protocol: str, nbytes: int) -> tuple[int, int]:
    """(blocks, threads) of a derived row: the model is per CTA and does not choose them. LL
    rows are decode-sized (8 CTAs); flag rows take 16 CTAs to 128 KiB, then 32 of 512."""
    if protocol in FLAG_IN_DATA:
        return 8, 256
    return (16, 256) if nbytes <= 128 * 1024 else (32, 512)


def buckets() -> list[tuple[int, int | None, int]]:
    """(min_bytes, max_bytes or None for open, the size the bucket is judged at)."""
    out: list[tuple[int, int | None, int]] = []
    lo, hi = 0, FIRST_EDGE
    while hi <= LAST_EDGE:
        judged = int(math.sqrt(max(lo, FIRST_EDGE // 2) * hi)) // 16 * 16
        out.append((lo, hi, judged))
        lo, hi = hi, hi * 2
    out.append((lo, None, lo * 3 // 2))
    return out


def rank_tactics(
    world: int,
    island_of: Sequence[int],
    transport: str,
    nbytes: int,
    constants: dict[str, float] | None = None,
    executor: dict[str, Any] | None = None,
    collective: str = "all_reduce",
) -> list[dict[str, Any]]:
    """Every tactic the builders accept here (push only over P2P), fastest first by the model;
    a tie goes to the unstaged tactic (fewer fences), then to the plan layer's order. `nbytes`
    is the whole message (a reduce-scatter's input, an all-gather's output)."""
    rows = []
    for t in _C.buildable_tactics(world, list(island_of), collective):
        # Pull over P2P is the fabric's call: some switches collapse on peer writes, root
        # complexes on peer reads (docs/tuning.md), and the model knows neither; only a tune
        # may pick it there. On host memory both directions cross the same links.
        if t["direction"] == "pull" and transport != "cuda_host":
            continue
        if t["protocol"] in FLAG_IN_DATA and nbytes > MAX_LL_BYTES:
            continue
        s = _C.build_schedule(
            t["algorithm"],
            world,
            list(island_of),
            t["direction"],
            t["staged"],
            t["protocol"],
            collective,
        )
        c = s.cost(nbytes, transport=transport, constants=constants or {}, executor=executor or {})
        rows.append(
            {**t, "modelled_us": c["modelled_us"], "serial_round_trips": c["serial_round_trips"]}
        )
    rows.sort(key=lambda r: (round(r["modelled_us"], 6), r["staged"]))
    return rows


def row_prefix(collective: str) -> str:
    """What a table row's algorithm column starts with when the row decides ``collective``:
    nothing for the all-reduce, ``reduce_scatter:`` / ``all_gather:`` for the others."""
    return "" if collective == "all_reduce" else f"{collective}:"


def _tactic_columns(best: dict[str, Any], judged: int, collective: str = "all_reduce") -> str:
    """Table columns 6.. of a derived row: the tactic and its launch shape (a reduce-scatter's
    or all-gather's algorithm named after its collective, ``reduce_scatter:twoshot``)."""
    blocks, threads = launch_shape(best["protocol"], judged)
    tactic = f"{best['algorithm']},{best['direction']},{int(best['staged'])},{blocks},{threads}"
    text = row_prefix(collective) + tactic
    return text + ("" if best["protocol"] == "flag" else f",{best['protocol']}")


def derive_rows(
    key: str,
    world: str,
    island_of: Sequence[int],
    transport: str,
    constants: dict[str, float] | None = None,
    executor: dict[str, Any] | None = None,
    collective: str = "all_reduce",
) -> list[str]:
    """The table rows of one topology key: adjacent buckets with the same best tactic and launch
    shape merge into one row."""
    runs: list[list[Any]] = []  # [min_bytes, max_bytes or None, columns]
    for lo, hi, judged in buckets():
        best = rank_tactics(
            len(island_of), island_of, transport, judged, constants, executor, collective
        )[0]
        columns = _tactic_columns(best, judged, collective)
        if runs and runs[-1][2] == columns:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi, columns])
    return [
        f"{key},{world},*,{lo},{'*' if hi is None else hi},{columns}" for lo, hi, columns in runs
    ]


def derive_seed_rows(
    constants: dict[str, float] | None = None, executor: dict[str, Any] | None = None
) -> list[str]:
    """Every GPU family's rows: the all-reduce's, then the reduce-scatter's and all-gather's
    (each collective judged by its own modelled cost, not derived from the all-reduce's)."""
    rows: list[str] = []
    for key, world, island_of, transport in gpu_families():
        for collective in COLLECTIVES:
            rows.extend(
                derive_rows(key, world, island_of, transport, constants, executor, collective)
            )
    return rows


if __name__ == "__main__":
    for row in derive_seed_rows():
        print(row)
