"""What a tune measures: for each operation it tunes (the all-reduce, whose rows the fused op
uses too, the reduce-scatter and the all-gather), every candidate (each tactic the plan layer
builds for that operation here, in every (blocks, threads) shape worth trying on this transport,
then the fallback) at every size bucket, and a candidate's table columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ... import policy
from ...native import _C
from ...plan import ALGORITHMS, PROTOCOLS
from ..model import COLLECTIVES

_HOST_SHAPES = ((1, 32), (2, 32))  # (blocks, threads): the host executor ignores threads
_CUDA_SHAPES = tuple((b, t) for b in (4, 8, 16, 32) for t in (256, 512))
_FALLBACK_ROW = "fallback,,,,,"

# The operations a tune measures, each against its own fallback: the collectives with table rows
# of their own. The fused all-reduce + add + RMSNorm has none: the all-reduce's rows decide it.
TUNED_OPS = COLLECTIVES
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = COLLECTIVES
_CHUNK_BYTES = 16  # a collective's chunk on each rank is whole 16-byte vectors


@dataclass(frozen=True)
class Candidate:
    """One contender: a tactic label (or ``fallback``) and its table columns 6..11."""

    label: str
    columns: str


def op_of_algorithm(algorithm: str) -> str:
    """The operation a row decides, from its algorithm column (``reduce_scatter:twoshot``)."""
    return algorithm.split(":", 1)[0] if ":" in algorithm else ALL_REDUCE


def message_size(op: str, size: int, world: int) -> int:
    """The size a bucket measures ``op`` at: the bucket's size for the all-reduce; for a
    collective, whose message is the whole tensor (reduce-scatter's input, all-gather's output)
    split into one chunk of whole 16-byte vectors per rank, the bucket's size rounded down to a
    multiple of ``world`` x 16 bytes (0: the bucket is too small to measure)."""
    if op == ALL_REDUCE:
        return size
    step = world * _CHUNK_BYTES
    return size // step * step


def candidates(
    transport: str,
    world: int,
    island_of: Sequence[int],
    max_blocks: int,
    op: str = ALL_REDUCE,
) -> list[Candidate]:
    """Every tactic the plan layer builds for ``op`` here, in every (blocks, threads) shape
    worth trying on this transport, then the fallback (for a collective: the group's own)."""
    shapes = _HOST_SHAPES if transport == policy.HOST_SHM else _CUDA_SHAPES
    out: list[Candidate] = []
    for algorithm in ALGORITHMS:
        for direction in ("push", "pull"):
            for staged in (False, True):
                for protocol in PROTOCOLS:
                    if (
                        _C.why_unsupported(
                            algorithm, world, list(island_of), direction, staged, protocol, op
                        )
                        is not None
                    ):
                        continue
                    for blocks, threads in shapes:
                        if blocks > max_blocks:
                            continue
                        label = (
                            f"{algorithm}/{direction}/{'staged' if staged else 'unstaged'}"
                            f"/{protocol}/b{blocks}/t{threads}"
                        )
                        columns = (
                            f"{algorithm},{direction},{int(staged)},{blocks},{threads},{protocol}"
                        )
                        out.append(Candidate(label, columns))
    out.append(Candidate("fallback", _FALLBACK_ROW))
    return out


def columns_of_label(label: str) -> str:
    """Table columns 6..11 for a tactic label ``alg/dir/staged|unstaged/proto/bN/tM``."""
    if label == "fallback":
        return _FALLBACK_ROW
    algorithm, direction, staged, protocol, blocks, threads = label.split("/")
    staged_flag = int(staged == "staged")
    return f"{algorithm},{direction},{staged_flag},{blocks[1:]},{threads[1:]},{protocol}"


def buckets(max_bytes: int, min_bytes: int = 1024) -> list[tuple[int, int, int]]:
    """(lo, measured size, hi) per bucket: sizes 1 KiB, 2 KiB, ... up to ``max_bytes``; each
    bucket reaches halfway (geometrically) to its neighbours, the first from 0 and the last to
    no bound (hi = -1), boundaries on 16 bytes."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    if not sizes:
        sizes = [max(16, max_bytes // 16 * 16)]
    edges = [0] + [int(s * 1.4142135623730951) // 16 * 16 for s in sizes[:-1]] + [-1]
    return [(edges[i], s, edges[i + 1]) for i, s in enumerate(sizes)]
