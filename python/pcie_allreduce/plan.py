"""The plan layer from Python: build a schedule, verify it, look at its steps.

>>> s = build("island_twoshot", 8, islands=[[0, 1, 2, 3], [4, 5, 6, 7]])
>>> s.verify()["cross_island_elements"]
1.0
>>> build("oneshot", 8, staged=False, protocol="ll").cost()["system_fences"]
0
"""

from __future__ import annotations

from collections.abc import Sequence

from .native import _C, Schedule

ALGORITHMS = tuple(_C.algorithms())
PROTOCOLS = tuple(_C.protocols())
# The protocols whose data carries its own arrival (LL slots, no flags; plan::flag_in_data):
# every protocol but flag.
FLAG_IN_DATA = tuple(p for p in PROTOCOLS if p != "flag")


def island_map(world: int, islands: Sequence[Sequence[int]] | None) -> list[int]:
    """rank -> island index from a list of islands (lists of ranks); [] for flat."""
    if islands is None:
        return []
    island_of = [-1] * world
    for index, members in enumerate(islands):
        for rank in members:
            if not 0 <= rank < world:
                raise ValueError(f"island {index} names rank {rank}, outside world {world}")
            if island_of[rank] != -1:
                raise ValueError(f"rank {rank} appears in more than one island")
            island_of[rank] = index
    missing = [r for r, i in enumerate(island_of) if i == -1]
    if missing:
        raise ValueError(f"ranks {missing} are in no island; islands must cover 0..{world - 1}")
    return island_of


def build(
    algorithm: str,
    world: int,
    islands: Sequence[Sequence[int]] | None = None,
    direction: str = "push",
    staged: bool = True,
    protocol: str = "flag",
    collective: str = "all_reduce",
) -> Schedule:
    """A schedule for `algorithm` on `world` ranks; ValueError says why one cannot be built.

    protocol="ll" builds the flag-in-data variant (push, unstaged): no fences, no flag words,
    every reader polls only its own memory; protocol="lamport" the same steps with the payload
    stored as it is (half of LL's bytes; an empty-word sentinel instead of tags). `.cost()` on
    the result counts what each rank pays. collective="reduce_scatter" or "all_gather" builds
    that half of a two-shot algorithm (twoshot, island_twoshot).
    """
    return _C.build_schedule(
        algorithm, world, island_map(world, islands), direction, staged, protocol, collective
    )


def why_unsupported(
    algorithm: str,
    world: int,
    islands: Sequence[Sequence[int]] | None = None,
    direction: str = "push",
    staged: bool = False,
    protocol: str = "flag",
    collective: str = "all_reduce",
) -> str | None:
    return _C.why_unsupported(
        algorithm, world, island_map(world, islands), direction, staged, protocol, collective
    )
