#!/usr/bin/env python3
"""Checks the CUDA executor's machine code (SASS): the LL and lamport first looks are parallel,
delivery loads once for every destination, nothing spills.

    check_sass.py --tools DIR --object launch.cu.o          # the object the build made (CTest)
    check_sass.py --tools DIR --compile --arch 90 --arch 120 [--csrc DIR] [--nvcc PATH]
    ... [--order-archs 86,89,90,100,120]    # where (a) fails the check; elsewhere it is reported

DIR is where .ci/setup unpacked the PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
(the script finds bin/cuobjdump below it). --object may be repeated; an argument holding a
;-separated list (as CMake's $<TARGET_OBJECTS> gives it) keeps only the objects named launch.cu*.
Every architecture in the object is checked. --compile builds
csrc/transport/executors/cuda/launch.cu (of --csrc, default this tree's) for each --arch instead.
Python 3 standard library only. Exit 0: every check passed; 1: a check failed; 2: nothing to
check (a missing tool or object, or a push kernel in which the heuristic below finds no LL or
no lamport first look: then the heuristic needs updating, and the check says so rather than pass).
Pull kernels carry no LL code (LL and lamport are push-only; run_reduce traps instead), so they
are checked for (b) only.

What is checked, in every executor kernel (executor_kernel<T, D>) of every architecture:

(b) No local memory: no LDL or STL instruction (a spill, or an array the compiler could not keep
    in registers). ptxas's own -warn-spills also catches spills; this catches any local memory.

(a) The first look of an LL group is parallel: every LL load of the group is issued before the
    first compare of any of the group's tags. (gather_ll_group in executor.cuh: a compare between
    two loads makes the second load wait for the first one's round trip.)

(c) The same for a lamport group: every lamport load of the group is issued before the first
    compare of any of its words with the empty word (kLLEmpty, 0x80000000).

(d) Delivery loads once: a run of copies of one chunk to several peers is one
    loop that loads each vector once and stores it to every destination (run_fanout in
    executor.cuh), up to kMaxFanout = 7 destinations, both to plain slots (flag) and to LL slots
    (LL and lamport: volatile stores).

The heuristic for (a), on the instruction listing in address order:

  * An LL load pair is how load_ll reads payload vector v of an LL slot: two 16-byte global
    loads from the same base register at offsets o and o + 0x10 (the LL vectors 2v and 2v + 1),
    under the same guard predicate, both volatile (LDG.E.128 with STRONG.SYS in SASS). Plain
    operands (ld.cg/ld.cv) are single 16-byte loads: they never form such a pair in the executor.
  * A tag word is register d+1 or d+3 of either load's destination quad d..d+3 ({data, tag,
    data, tag}), followed through plain register moves (MOV, IMAD.MOV) until overwritten.
  * A tag compare is an ISETP that reads a tag word.
  * A first look is what lies between two separators: a store or atomic (the LL resets, the
    result's store), a read of the global timer (await_ll, the slow path, starts with one, and
    so does its every timeout check), a backward branch (a loop), a barrier, fence, call, trap
    or exit. The code of one group's first look contains none of these, so it is one window;
    the slow path's polls and the next group are in other windows.
  * In each window, the last LL load must come before the first tag compare. The old shape
    (each operand's tags compared right after its own pair, before the next operand's loads)
    fails this in every window with two or more LL pairs.

The heuristic for (c), in the same windows: a lamport compare is an ISETP that reads the
destination of a volatile 16-byte load (followed through moves, as tags are) against the
immediate -0x80000000 (kLLEmpty as SASS prints it); a lamport load is such a load that is not half
of an LL pair (one LL vector per payload vector) and that some lamport compare of the window
reads. Plain operands on host memory (ld.cv) are volatile loads too, but nothing compares them
with the empty word.

The heuristic for (d): an innermost loop is the code between a backward branch and its target
with no other backward branch inside. Its fan-out is the number of its 16-byte global stores
(the two halves of an LL payload, at o and o + 0x10 of one base register, count once), divided
by the number of its 16-byte global loads (an unrolled loop has as many of each per iteration).
Per push kernel, the widest fan-out of loops storing
plain (st.global.cg) and of loops storing volatile (LL, lamport) must both reach 7. A loop that
re-loads its source per destination (one copy step at a time) has a fan-out of 1.

(e) One look per reduce in the decode-shaped kernels (push, __launch_bounds__(256): the third
    template argument): the widest LL first look holds 8 LL pairs and the widest lamport first
    look 8 lamport loads (plan::kMaxSources), so with (a) and (c) every operand of a reduce is in
    flight before the first compare. The large-message kernels (1024) take theirs a few at a time
    (kLLGroup in primitives_gpu.cuh). Enforced where (a) is.

(f) The decode-shaped kernels store a reduce's result before they reset the words it consumed:
    after each look of two or more operands, the next 16-byte global store in address order is
    not a reset (four empty words: each data register last written, in address order, with
    kLLEmpty: a move of the immediate, or ptxas's fp16x2 -0 * 0 + (-0.0, 0)). The slow path
    between a look and its store stores nothing of 16 bytes. The large-message kernels reset each
    group after its look: every one of their looks is followed by a reset, and a push kernel of
    theirs with none found means the heuristic needs updating (exit 2).

The check also requires that every push kernel holds windows with two or more LL pairs and
windows with two or more lamport loads: if none are found the SASS has changed shape and the
heuristic must be revisited.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path("transport/executors/cuda/launch.cu")
KERNEL = "executor_kernel"

INSN = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P[T0-9]+)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
ARCH = re.compile(r"^\s*arch = (sm_\d+[a-z]?)")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
REG = re.compile(r"\bR(\d+)\b")
ADDRESS = re.compile(r"\[(R\d+)(?:\.64)?(?:\s*\+\s*(0x[0-9a-f]+|\d+))?\]\s*$")
STORE = re.compile(r"^(ST[GSL]?|ATOMS?|ATOMG|RED[GE]?)(\.|$)")
SEPARATOR_OPS = (
    "EXIT",
    "RET",
    "CALL",
    "BPT",
    "BAR",
    "MEMBAR",
    "FENCE",
    "ERRBAR",
    "WARPSYNC",
    "BRK",
    "KILL",
)
MOVES = ("MOV", "IMAD.MOV", "IMAD.MOV.U32")
# How many registers the first operand of these writes (the rest write one).
WIDE = ((".128", 4), (".64", 2), ("IMAD.WIDE", 2), ("LDC.64", 2), ("CS2R", 2))


@dataclass
class Insn:
    addr: int
    pred: str  # "" when unguarded
    op: str
    args: list[str]
    text: str

    def dests(self) -> list[int]:
        if not self.args or STORE.match(self.op) or self.op.startswith(("BRA", "ISETP", "FSETP")):
            return []
        m = re.fullmatch(r"R(\d+)", self.args[0].strip())
        if not m:
            return []
        width = next((w for key, w in WIDE if key in self.op), 1)
        return list(range(int(m.group(1)), int(m.group(1)) + width))

    def sources(self) -> set[int]:
        skip = 1 if self.dests() else 0
        return {int(r) for a in self.args[skip:] for r in REG.findall(a)}


@dataclass
class Pair:
    lo: Insn
    hi: Insn
    index: int  # position of the later of the two loads


@dataclass
class Window:
    insns: list[Insn] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    first_compare: tuple[int, Insn] | None = None
    # Lamport: the volatile loads that are not half of a pair, and the first compare of one of
    # their words with kLLEmpty.
    dense: list[tuple[int, Insn]] = field(default_factory=list)
    first_dense_compare: tuple[int, Insn] | None = None


def parse(sass: str) -> dict[tuple[str, str], list[Insn]]:
    """{(arch, function): instructions} for the executor kernels of a cuobjdump -sass listing."""
    out: dict[tuple[str, str], list[Insn]] = {}
    arch, current = "?", None
    for line in sass.splitlines():
        if m := ARCH.match(line):
            arch = m.group(1)
            continue
        if m := FUNCTION.match(line):
            current = out.setdefault((arch, m.group(1)), []) if KERNEL in m.group(1) else None
            continue
        if current is not None and (m := INSN.match(line)):
            args = [a.strip() for a in m.group(4).split(",")] if m.group(4).strip() else []
            current.append(
                Insn(
                    int(m.group(1), 16),
                    m.group(2) or "",
                    m.group(3),
                    args,
                    f"/*{m.group(1)}*/ {(m.group(2) or '') + ' '}{m.group(3)} "
                    f"{m.group(4).strip()}".replace("  ", " "),
                )
            )
    return out


def is_ll_load(i: Insn) -> bool:
    return i.op.startswith("LDG") and ".128" in i.op and "STRONG.SYS" in i.op


EMPTY_WORD = "-0x80000000"  # kLLEmpty as an ISETP immediate
MAX_FANOUT = 7  # kMaxFanout in executor.cuh: every peer of an 8-rank world
DECODE_THREADS = 256  # kDecodeThreads in kernel_params.h: the decode-shaped kernels' bound
ONE_LOOK = 8  # plan::kMaxSources: the operands of the widest reduce
STORE_ADDRESS = re.compile(r"\[(R\d+)(?:\.64)?(?:\s*\+\s*(0x[0-9a-f]+|\d+))?\]")


def is_separator(i: Insn) -> bool:
    if STORE.match(i.op) or i.op.split(".")[0] in SEPARATOR_OPS:
        return True
    if any("SR_GLOBALTIMER" in a for a in i.args):
        return True
    if i.op.startswith("BRA") and i.args:
        target = re.match(r"`?\(?(0x[0-9a-f]+)", i.args[-1])
        if target and int(target.group(1), 16) <= i.addr:
            return True
    return False


def follow_load(
    loaded: dict[int, int], i: Insn, d: int, src: re.Match[str] | None, key: int
) -> None:
    """Register d once i has written it: loaded[d] names the volatile load it holds (`key` when i
    is one), followed through a plain move (`src`: the moved register), and is forgotten when i
    overwrites it unconditionally."""
    if is_ll_load(i):
        loaded[d] = key
    elif src and int(src.group(1)) in loaded:
        loaded[d] = loaded[int(src.group(1))]
    elif d in loaded and not i.pred:
        del loaded[d]


def negation(pred: str) -> str:
    return pred.replace("@!", "@") if pred.startswith("@!") else pred.replace("@", "@!")


def windows(insns: list[Insn]) -> list[Window]:
    """The listing cut at separators, each piece with its LL pairs, its lamport loads and the
    first compare of each kind."""
    found: list[Window] = []
    w = Window()
    open_lo: list[tuple[Insn, str, int]] = []  # loads waiting for their +0x10 partner
    tags: dict[int, str] = {}  # register -> guard predicate of the pair it came from
    loaded: dict[int, int] = {}  # register -> id() of the volatile load that wrote it
    sys_loads: list[tuple[int, Insn]] = []
    empty_compares: list[tuple[int, Insn, set[int]]] = []  # with the loads they read

    def close() -> None:
        nonlocal w
        paired = {id(p.lo) for p in w.pairs} | {id(p.hi) for p in w.pairs}
        compared = set().union(*(reads for _, _, reads in empty_compares))
        w.dense = [(k, i) for k, i in sys_loads if id(i) not in paired and id(i) in compared]
        dense_ids = {id(i) for _, i in w.dense}
        w.first_dense_compare = next(
            ((k, i) for k, i, reads in empty_compares if reads & dense_ids), None
        )
        if w.pairs or len(w.dense) >= 2:
            found.append(w)
        w = Window()
        open_lo.clear()
        tags.clear()
        loaded.clear()
        sys_loads.clear()
        empty_compares.clear()

    for i in insns:
        if is_separator(i):
            close()
            continue
        w.insns.append(i)
        index = len(w.insns) - 1
        if i.op.startswith("ISETP") and w.first_compare is None and tags.keys() & i.sources():
            w.first_compare = (index, i)
        if i.op.startswith("ISETP") and EMPTY_WORD in i.args:
            reads = {loaded[r] for r in i.sources() if r in loaded}
            if reads:
                empty_compares.append((index, i, reads))
        if is_ll_load(i):
            sys_loads.append((index, i))
        if is_ll_load(i) and (m := ADDRESS.search(i.args[-1])):
            base, offset = m.group(1), int(m.group(2) or "0", 0)
            lo = next(
                (
                    x
                    for x in open_lo
                    if x[1] == base and x[2] == offset - 0x10 and x[0].pred == i.pred
                ),
                None,
            )
            if lo is not None:
                open_lo.remove(lo)
                w.pairs.append(Pair(lo[0], i, index))
                for d in lo[0].dests()[1::2] + i.dests()[1::2]:
                    tags[d] = i.pred
                for d in i.dests():
                    loaded[d] = id(i)
                continue  # its destinations are the tags just recorded
            open_lo.append((i, base, offset))
        written = i.dests()
        if not written:
            continue
        # A base register rewritten: loads before it cannot pair with loads after it.
        open_lo[:] = [x for x in open_lo if int(x[1][1:]) not in written]
        src = re.fullmatch(r"R(\d+)", i.args[-1]) if i.op in MOVES else None
        for d in written:
            if src and int(src.group(1)) in tags:
                tags[d] = tags[int(src.group(1))]
            elif d in tags and not (i.pred and tags[d] == negation(i.pred)):
                del tags[d]
            follow_load(loaded, i, d, src, id(i))
    close()
    return found


@dataclass
class Look:
    """A decode-shaped kernel's first look: the volatile 16-byte loads of a window issued before
    the window's first compare of a volatile-loaded word, and the loads after that compare that a
    later compare of the window reads (late: they waited for the compare)."""

    insns: list[Insn]
    loads: list[int]  # indices into insns, before first_compare
    first_compare: int
    late_loads: list[int]
    lamport: bool  # the first compare tests a word against the empty word; else an LL tag
    reset_next: bool  # the next 16-byte store after the window is a reset (see reset_store)

    @property
    def late(self) -> bool:
        return bool(self.late_loads)


def compared_looks(insns: list[Insn]) -> list[Look]:
    """The windows (cut at separators, as windows() cuts them) in which a compare reads a word
    of a volatile 16-byte load, followed through moves. The decode-shaped kernels load an LL
    operand's second LL vector at a computed address (+1 vector, +0 for a plain operand:
    gather_ll_group's Decode), so their pairs are not +0x10 apart, and ptxas may sink an
    operand's compares into the slow path of the operand before it (other windows): what (a),
    (c) and (e) ask of them is how many loads are in flight at the first compare, and that no
    load the window compares waits for it."""
    found: list[Look] = []
    body: list[Insn] = []
    loads: list[int] = []
    loaded: dict[int, int] = {}  # register -> index of the volatile load that wrote it
    first: int | None = None
    compared_after: set[int] = set()

    def close(end: int) -> None:
        nonlocal body, loads, first, compared_after
        if first is not None and len(loads) >= 2:
            before = [k for k in loads if k < first]
            late = sorted(k for k in compared_after if k > first)
            reset = resets_next(insns, end, writes)
            found.append(Look(body, before, first, late, EMPTY_WORD in body[first].args, reset))
        body, loads, first, compared_after = [], [], None, set()
        loaded.clear()

    writes = register_writes(insns)
    for at, i in enumerate(insns):
        if is_separator(i):
            close(at)
            continue
        body.append(i)
        k = len(body) - 1
        if i.op.startswith("ISETP"):
            reads = {loaded[r] for r in i.sources() if r in loaded}
            if reads and first is None:
                first = k
            elif reads:
                compared_after |= reads
        if is_ll_load(i):
            loads.append(k)
        src = re.fullmatch(r"R(\d+)", i.args[-1]) if i.op in MOVES and i.args else None
        for d in i.dests():
            follow_load(loaded, i, d, src, k)
    close(len(insns))
    return found


def resets_next(insns: list[Insn], start: int, writes: dict[int, list[tuple[int, bool]]]) -> bool:
    """Whether the first 16-byte global store from insns[start] on, in address order, is a reset
    (reset_ll: four empty words, each data register last written with kLLEmpty before it, in
    address order). The slow path between a look and what follows it stores nothing of 16 bytes
    (a failure record is 32-bit words), so this is either the look's reset or its result."""
    for at in range(start, len(insns)):
        i = insns[at]
        if not (i.op.startswith("STG") and ".128" in i.op):
            continue
        m = re.fullmatch(r"R(\d+)", i.args[1].strip()) if len(i.args) > 1 else None
        if m is None:
            return False
        return all(
            (w := writes.get(r)) is not None
            and (k := bisect.bisect_left(w, (at, False)) - 1) >= 0
            and w[k][1]
            for r in range(int(m.group(1)), int(m.group(1)) + 4)
        )
    return False


# How ptxas materialises kLLEmpty (0x80000000) in a register: a move of the immediate (MOV.64 two
# at once, on sm_120), or an fp16x2 fused multiply-add of -0 * 0 + (-0.0, 0).
EMPTY_IMMEDIATES = (EMPTY_WORD, "0x80000000", "0x8000000080000000")


def writes_empty(i: Insn) -> bool:
    if (i.op in MOVES or i.op == "MOV.64") and i.args and i.args[-1] in EMPTY_IMMEDIATES:
        return True
    return i.op.startswith("HFMA2") and i.args[1:] == ["-RZ", "RZ", "-0.0", "0"]


def register_writes(insns: list[Insn]) -> dict[int, list[tuple[int, bool]]]:
    """Per register, the positions that write it and whether each writes the empty word."""
    out: dict[int, list[tuple[int, bool]]] = {}
    for at, i in enumerate(insns):
        for d in i.dests():
            out.setdefault(d, []).append((at, writes_empty(i)))
    return out


def look_excerpt(look: Look) -> str:
    """A late look's compared loads and its first compare, in listing order."""
    marks = {k: "load" for k in look.loads} | {k: "late load" for k in look.late_loads}
    marks[look.first_compare] = "first compare"
    return "\n".join(
        f"      {look.insns[k].text:70} <- {what}" for k, what in sorted(marks.items())
    )


def backward_target(i: Insn) -> int | None:
    if i.op.startswith("BRA") and i.args:
        target = re.match(r"`?\(?(0x[0-9a-f]+)", i.args[-1])
        if target and int(target.group(1), 16) <= i.addr:
            return int(target.group(1), 16)
    return None


def fanouts(insns: list[Insn]) -> dict[str, int]:
    """The widest fan-out of the innermost loops, by the kind of store:
    {'plain': w, 'volatile': w}."""
    branches = [(backward_target(i), i.addr) for i in insns]
    loops = [(t, a) for t, a in branches if t is not None]
    widest = {"plain": 0, "volatile": 0}
    for target, end in loops:
        if any(target <= t and a < end for t, a in loops if (t, a) != (target, end)):
            continue  # not innermost
        body = [i for i in insns if target <= i.addr <= end]
        loads = [i for i in body if i.op.startswith("LDG") and ".128" in i.op]
        stores = [i for i in body if i.op.startswith("STG") and ".128" in i.op]
        if not loads or not stores:
            continue
        kind = "volatile" if all("STRONG.SYS" in i.op for i in stores) else "plain"
        payloads, last = 0, None
        for i in stores:
            m = STORE_ADDRESS.search(i.args[0])
            at = (m.group(1), int(m.group(2) or "0", 0)) if m else None
            if not (at and last and at == (last[0], last[1] + 0x10)):
                payloads += 1  # not the upper half of the LL payload stored just before
            last = at
        widest[kind] = max(widest[kind], payloads // len(loads))
    return widest


@dataclass
class Report:
    arch: str
    kernel: str
    lmem: list[Insn]
    looks: int  # windows with two or more LL pairs
    widest: int
    late: Sequence[Window | Look]  # windows where a tag compare precedes an LL load
    dense_looks: int  # windows with two or more lamport loads
    dense_widest: int
    dense_late: Sequence[Window | Look]  # where an empty-word compare precedes a lamport load
    fanout: dict[str, int]  # the widest delivery loop per kind of store
    # Multi-operand looks (compared_looks) and those whose next 16-byte store is a reset: (f).
    operand_looks: int = 0
    reset_first: int = 0


def operand_looks(insns: list[Insn]) -> tuple[list[Look], list[Look]]:
    """A kernel's LL looks of two or more operands (four loads) and its lamport looks of two or
    more (compared_looks)."""
    looks = compared_looks(insns)
    ll = [x for x in looks if not x.lamport and len(x.loads) >= 4]  # two loads an operand
    return ll, [x for x in looks if x.lamport]


def check(arch: str, kernel: str, insns: list[Insn]) -> Report:
    lmem = [i for i in insns if i.op.startswith(("LDL", "STL"))]
    ll, lamport = operand_looks(insns) if is_push(kernel) else ([], [])
    resets = (len(ll) + len(lamport), sum(x.reset_next for x in ll + lamport))
    if is_push(kernel) and bound(kernel) == DECODE_THREADS:
        return Report(
            arch,
            kernel,
            lmem,
            len(ll),
            max((len(x.loads) // 2 for x in ll), default=0),
            [x for x in ll if x.late],
            len(lamport),
            max((len(x.loads) for x in lamport), default=0),
            [x for x in lamport if x.late],
            fanouts(insns),
            *resets,
        )
    found = windows(insns)
    multi = [w for w in found if len(w.pairs) >= 2]
    late = [w for w in multi if w.first_compare and w.first_compare[0] < w.pairs[-1].index]
    dense = [w for w in found if len(w.dense) >= 2]
    dense_late = [
        w for w in dense if w.first_dense_compare and w.first_dense_compare[0] < w.dense[-1][0]
    ]
    return Report(
        arch,
        kernel,
        lmem,
        len(multi),
        max((len(w.pairs) for w in multi), default=0),
        late,
        len(dense),
        max((len(w.dense) for w in dense), default=0),
        dense_late,
        fanouts(insns),
        *resets,
    )


def is_push(kernel: str) -> bool:
    m = re.search(r"DirectionE(\d)", kernel)
    return m is not None and m.group(1) == "0"


def bound(kernel: str) -> int:
    """The instantiation's __launch_bounds__ (its third template argument)."""
    m = re.search(r"DirectionE\dELi(\d+)E", kernel)
    return int(m.group(1)) if m else 1024


def short(kernel: str) -> str:
    m = re.search(r"executor_kernelI(.+?)LNS_4plan9DirectionE(\d)", kernel)
    if not m:
        return kernel
    dtype = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32"}.get(m.group(1), m.group(1))
    return f"executor_kernel<{dtype}, {'push' if m.group(2) == '0' else 'pull'}, {bound(kernel)}>"


def excerpt(w: Window | Look, dense: bool = False) -> str:
    """The window's LL (or lamport) loads and its first compare of them, in listing order."""
    if isinstance(w, Look):
        return look_excerpt(w)
    if dense:
        marks = {id(i): "lamport load" for _, i in w.dense}
        assert w.first_dense_compare is not None
        marks[id(w.first_dense_compare[1])] = "first empty-word compare"
    else:
        marks = {id(p.lo): "LL load" for p in w.pairs} | {id(p.hi): "LL load" for p in w.pairs}
        assert w.first_compare is not None
        marks[id(w.first_compare[1])] = "first tag compare"
    lines = [f"      {i.text:70} <- {marks[id(i)]}" for i in w.insns if id(i) in marks]
    return "\n".join(lines)


def find_cuobjdump(tools: Path) -> Path:
    hits = sorted(p for p in tools.rglob("cuobjdump") if p.is_file() and p.parent.name == "bin")
    if not hits:
        sys.stderr.write(
            f"check_sass: no bin/cuobjdump under {tools}: run .ci/setup (it installs "
            "the PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm there)\n"
        )
        sys.exit(2)
    return hits[-1]


def compile_objects(nvcc: str, csrc: Path, archs: list[str], into: Path) -> list[Path]:
    objects = []
    for arch in archs:
        obj = into / f"launch_sm{arch}.o"
        cmd = [
            nvcc,
            "-std=c++20",
            "-O3",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            f"-I{csrc}",
            "-c",
            str(csrc / LAUNCH),
            "-o",
            str(obj),
        ]
        done = subprocess.run(cmd, text=True, capture_output=True)
        if done.returncode != 0:
            sys.stderr.write(f"check_sass: {' '.join(cmd)} failed:\n{done.stderr[-4000:]}\n")
            sys.exit(2)
        objects.append(obj)
    return objects


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tools",
        type=Path,
        required=True,
        help="where .ci/setup unpacked the cuobjdump and nvdisasm wheels",
    )
    parser.add_argument(
        "--object",
        action="append",
        default=[],
        help="an object holding the executor (repeatable; ';'-separated lists too)",
    )
    parser.add_argument("--compile", action="store_true", help="compile launch.cu instead")
    parser.add_argument("--arch", action="append", default=[], help="with --compile: 90, 120, ...")
    parser.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="with --compile")
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="with --compile")
    parser.add_argument(
        "--order-archs",
        default="",
        help="comma-separated architectures (90, sm_90) where a serial first look "
        "fails the check (default: every one); elsewhere it is only reported",
    )
    args = parser.parse_args()
    start = time.monotonic()
    cuobjdump = find_cuobjdump(args.tools)
    env = dict(os.environ, PATH=f"{cuobjdump.parent}{os.pathsep}{os.environ.get('PATH', '')}")

    with tempfile.TemporaryDirectory() as tmp:
        if args.compile:
            objects = compile_objects(
                args.nvcc, args.csrc.resolve(), args.arch or ["90", "120"], Path(tmp)
            )
        else:
            objects = [
                Path(o)
                for a in args.object
                for o in a.split(";")
                if o and (";" not in a or "launch.cu" in Path(o).name)
            ]
        if not objects:
            sys.stderr.write(
                "check_sass: no object to check (no --object, or a list without "
                "launch.cu's object, and no --compile)\n"
            )
            return 2
        kernels: dict[tuple[str, str], list[Insn]] = {}
        for obj in objects:
            if not obj.is_file():
                sys.stderr.write(f"check_sass: {obj} does not exist (build the project first)\n")
                return 2
            done = subprocess.run(
                [str(cuobjdump), "-sass", str(obj)], text=True, capture_output=True, env=env
            )
            if done.returncode != 0:
                sys.stderr.write(f"check_sass: cuobjdump -sass {obj} failed:\n{done.stderr}\n")
                return 2
            kernels |= parse(done.stdout)

    if not kernels:
        sys.stderr.write(
            "check_sass: no executor_kernel in the SASS: the heuristic needs updating\n"
        )
        return 2
    enforced = {
        a.strip() if a.strip().startswith("sm_") else f"sm_{a.strip()}"
        for a in args.order_archs.split(",")
        if a.strip()
    }
    failed, blind, reported = False, False, 0
    for (arch, kernel), insns in sorted(kernels.items()):
        r = check(arch, kernel, insns)
        enforce = not enforced or arch in enforced
        verdict = []
        if r.lmem:
            failed = True
            verdict.append(f"FAIL local memory: {len(r.lmem)} LDL/STL, first {r.lmem[0].text}")
        push = is_push(kernel)
        if push and r.looks == 0:
            blind = True
            verdict.append(
                "NO LL FIRST LOOK FOUND (two or more LL load pairs in one window): "
                "the heuristic needs updating"
            )
        if push and r.dense_looks == 0:
            blind = True
            verdict.append(
                "NO LAMPORT FIRST LOOK FOUND (two or more lamport loads in one "
                "window): the heuristic needs updating"
            )
        narrow = [k for k, w in r.fanout.items() if w < MAX_FANOUT]
        if push and narrow:
            failed = True
            verdict.append(
                f"FAIL delivery: no loop stores one load to {MAX_FANOUT} destinations "
                f"({', '.join(f'{k} {r.fanout[k]}' for k in narrow)} at most)"
            )
        if push and bound(kernel) == DECODE_THREADS and min(r.widest, r.dense_widest) < ONE_LOOK:
            failed |= enforce
            reported += not enforce
            verdict.append(
                f"{'FAIL' if enforce else 'REPORTED (not enforced on ' + arch + ')'} one look: "
                f"the decode-shaped kernel's widest first look takes {r.widest} LL and "
                f"{r.dense_widest} lamport operands, not every operand of a reduce ({ONE_LOOK})"
            )
        decode = push and bound(kernel) == DECODE_THREADS
        if decode and r.reset_first:
            failed |= enforce
            reported += not enforce
            verdict.append(
                f"{'FAIL' if enforce else 'REPORTED (not enforced on ' + arch + ')'} reset "
                f"before the result: in {r.reset_first} of {r.operand_looks} looks the next "
                "16-byte store is a reset, not the result's store"
            )
        if push and not decode and r.operand_looks and not r.reset_first:
            blind = True
            verdict.append(
                "NO RESET FOUND AFTER A LARGE-MESSAGE LOOK (they reset each group after its "
                "look): the reset heuristic of (f) needs updating"
            )
        if not push and (r.looks or r.dense_looks):
            failed = True
            verdict.append("FAIL a pull kernel holds LL code (LL and lamport are push-only)")
        for late, looks, what in (
            (r.late, r.looks, "a tag compare comes before the group's last LL load"),
            (
                r.dense_late,
                r.dense_looks,
                "an empty-word compare comes before the group's last lamport load",
            ),
        ):
            if late:
                failed |= enforce
                reported += not enforce
                verdict.append(
                    f"{'FAIL' if enforce else 'REPORTED (not enforced on ' + arch + ')'}"
                    f" serial first look: in {len(late)} of {looks} first looks {what}"
                )
        status = "; ".join(verdict) if verdict else "ok"
        looks = (
            f"first looks with 2+ operands: LL {r.looks} (widest {r.widest}), lamport "
            f"{r.dense_looks} (widest {r.dense_widest}); delivery fan-out plain "
            f"{r.fanout['plain']}, volatile {r.fanout['volatile']}"
            if push
            else "no LL code (pull)"
        )
        print(
            f"{arch:7} {short(kernel):32} {len(insns):6} insns, no LDL/STL: "
            f"{'no' if r.lmem else 'yes'}, {looks} -> {status}"
        )
        if r.late:
            print(excerpt(r.late[0]))
        if r.dense_late:
            print(excerpt(r.dense_late[0], dense=True))
    seconds = time.monotonic() - start
    if failed:
        print(f"check_sass: FAILED ({seconds:.1f} s)")
        return 1
    if blind:
        print(f"check_sass: NOTHING CHECKED for (a) in some kernel ({seconds:.1f} s)")
        return 2
    seen = {arch for arch, _ in kernels}
    where = f" on {', '.join(sorted(seen & enforced))}" if enforced else ""
    note = (
        f"; {reported} kernels with a serial first look where it is not enforced"
        if reported
        else ""
    )
    print(
        f"check_sass: passed: {len(kernels)} executor kernels, no local memory, every LL and "
        f"lamport first look issues all its loads before its first compare{where}{note}, "
        f"the decode-shaped kernels' one look takes all {ONE_LOOK} operands, "
        f"delivery loads once for up to {MAX_FANOUT} destinations ({seconds:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
