"""The table a tune installs and writes: the rows it measured (each operation's, the
collectives' with their ``reduce_scatter:`` / ``all_gather:`` prefix), then the table in use
before it, minus the rows those replace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...native import _C
from .sweep import op_of_algorithm


def tuned_rows(choices: list[dict[str, Any]], key: str, world: int) -> str:
    """The header and one row per measured (op, bucket), with its times beside the decision
    (``columns`` carries the op's prefix)."""
    lines = [
        "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,"
        "threads,protocol,time_us,fallback_us,incumbent,incumbent_us,noise_pct"
    ]
    for c in choices:
        hi = "*" if c["max_bytes"] < 0 else str(c["max_bytes"])
        lines.append(
            f"{key},{world},{c['dtype']},{c['min_bytes']},{hi},{c['columns']},"
            f"{c['time_us']:.2f},{c['fallback_us']:.2f},{c['incumbent']},"
            f"{c['incumbent_us']:.2f},{c['noise_pct']:.2f}"
        )
    return "\n".join(lines) + "\n"


def untuned_rows(
    original_text: str, key: str, world: int, dtypes: Sequence[str], ops: Sequence[str]
) -> str:
    """The table in use before, minus the rows the tuned ones replace: this topology's and
    world's rows of a tuned dtype for a tuned op. Every other row stays: another op's rows (an
    all-reduce-only tune keeps the collectives' rows, measured or not), other dtypes', the
    wildcard rows, which decide every size the tuned rows do not reach."""
    kept = []
    for line in _C.TuningTable.parse(original_text, "table").canonical_text().splitlines():
        topology, w, dtype, _, _, algorithm = line.split(",")[:6]
        if (
            topology == key
            and w == str(world)
            and dtype in dtypes
            and op_of_algorithm(algorithm) in ops
        ):
            continue
        kept.append(line)
    return (
        "# the table in use before this tune, for everything it did not measure\n"
        + "\n".join(kept)
        + "\n"
    )
