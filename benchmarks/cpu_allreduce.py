"""CPU all-reduce side by side: ours (host transport) vs DeepSpeed's shm op vs gloo vs a floor.

All candidates live in the same processes and reduce the same tensors; they are timed in
interleaved rounds (the order rotates each round, so the machine's fast and slow phases hit
every candidate alike). Every candidate is first checked on fresh deterministic inputs against
their float64 sum. Per size and candidate it prints the median over rounds of the slowest
rank's mean microseconds per call, and the median over rounds of each round's ratio to ours_.

    ours_      PcieAllReduce(None, "cpu").all_reduce_(t)    (in place)
    ours       PcieAllReduce(None, "cpu").all_reduce(t)     (out of place, allocates)
    streamed   all_reduce_(t) through a workspace of --stream-workspace bytes (1 MiB): messages
               above it run as rounds through it (plan/rounds.h)
    deepspeed  torch.ops.deepspeed.inference_all_reduce_(t) (DeepSpeed's ShareMemCommBuilder op)
    gloo       torch.distributed.all_reduce(t) on the gloo group
    floor      benchmarks/cpu_floor.cpp: copy-in, barrier, reduce own slice, barrier, copy-out

    .venv/bin/python benchmarks/cpu_allreduce.py --world 2 --dtype bf16
    .venv/bin/python benchmarks/cpu_allreduce.py --quick --world 2 4 --dtype bf16 fp32
    .venv/bin/python benchmarks/cpu_allreduce.py --world 2 4 --sizes 64K 1M 4M 16M 64M --skip floor

Without DeepSpeed (or when its op does not build) the deepspeed column is left out, saying
why. The floor and DeepSpeed's op are JIT-built with torch.utils.cpp_extension (needs ninja).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import queue as queue_mod
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# DeepSpeed picks its accelerator at import; on a CPU-only host it must be told.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

NAMES = ["ours_", "ours", "streamed", "deepspeed", "gloo", "floor"]
BASE = "ours_"
FLOOR_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_floor.cpp")
ADDR = "127.0.0.1"
MIN_ITERS = 3
MAX_ITERS = 20000


def _port() -> int:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return int(s.getsockname()[1])


def _floor_shm(port: int) -> str:
    return f"/pcie_bench_floor_{os.getuid()}_{port}"


def _deepspeed_shm(port: int, rank: int) -> str:
    # The name DeepSpeed's shm_initialize gives rank's workspace (csrc/cpu/comm/shm.cpp).
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{ADDR}_{port}_{rank}"


def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def _timed(fn: Callable[[], Any], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _agree(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _first_rank_then_rest(rank: int, build: Callable[[], Any]) -> tuple[Any, str | None]:
    """Rank 0 builds (JIT compile) first, the others load the cached build; every rank learns
    whether every rank succeeded."""
    result, why = None, None

    def attempt() -> None:
        nonlocal result, why
        try:
            result = build()
        except Exception as error:  # report and skip the column, whatever went wrong
            lines = str(error).strip().splitlines() or [""]
            why = f"{type(error).__name__}: {lines[-1]}"

    if rank == 0:
        attempt()
    dist.barrier()
    if rank != 0:
        attempt()
    if not _agree(why is None):
        return None, why or "failed on another rank"
    return result, None


def _load_deepspeed(
    rank: int, world: int, port: int, dtype: torch.dtype
) -> tuple[Callable | None, str | None]:
    def build() -> Any:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        builder = ShareMemCommBuilder()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError("ShareMemCommBuilder.is_compatible() is False on this host")
        module = builder.load(verbose=False)
        need = 1 if dtype == torch.float32 else 2  # DeepSpeed's own check (comm/torch.py)
        if module.vector_kernel_level() < need:
            raise RuntimeError(f"vector_kernel_level {module.vector_kernel_level()} < {need}")
        return module

    module, why = _first_rank_then_rest(rank, build)
    if module is None:
        return None, why
    # initialize() maps the shm workspaces only when LOCAL_SIZE == world (DeepSpeed's launcher
    # sets it); it names them after MASTER_ADDR/MASTER_PORT, set by our parent.
    module.initialize(world, rank)
    dist.barrier()  # every rank has mapped every workspace: nobody needs the names any more
    try:  # DeepSpeed never unlinks them
        os.unlink(os.path.join("/dev/shm", _deepspeed_shm(port, rank)))
    except FileNotFoundError:
        print(f"rank {rank}: DeepSpeed's shm segment was not where expected", file=sys.stderr)
    op = torch.ops.deepspeed.inference_all_reduce_
    return op, None


class _FloorLink:
    def __init__(self, rank: int, world: int, port: int, cap_bytes: int) -> None:
        from torch.utils.cpp_extension import load

        def build() -> Any:
            return load(
                name="pcie_bench_cpu_floor",
                sources=[FLOOR_SRC],
                extra_cflags=["-O3", "-march=native"],
                verbose=False,
            )

        self.module, self.why = _first_rank_then_rest(rank, build)
        self.floor = None
        if self.module is None:
            return
        name = _floor_shm(port)
        if rank == 0:
            self.floor = self.module.Floor(name, rank, world, cap_bytes, True)
        dist.barrier()
        if rank != 0:
            self.floor = self.module.Floor(name, rank, world, cap_bytes, False)
        dist.barrier()
        if rank == 0:
            self.floor.unlink()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_q) -> None:
    faulthandler.enable()  # a crash in any candidate's C++ names the Python line
    os.environ.update(MASTER_ADDR=ADDR, MASTER_PORT=str(port), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)  # also DeepSpeed's OpenMP loops: they run on torch's libgomp
    dist.init_process_group("gloo", init_method=f"tcp://{ADDR}:{port}", rank=rank, world_size=world)
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.testing import DTYPES, count_wrong, rank_input

    dtype = DTYPES[args.dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = [s for s in args.size_list if s % elem == 0]
    max_numel = (max(sizes) // elem + 7) // 8 * 8
    skipped: dict[str, str] = {name: "--skip" for name in args.skip}

    ar = PcieAllReduce(None, "cpu", max_numel=max_numel)
    small = None
    if "streamed" not in skipped:
        small_numel = max(8, args.stream_workspace // elem // 8 * 8)
        small = PcieAllReduce(None, "cpu", max_numel=small_numel, stream_max_numel=max_numel)
    ds_op = None
    if "deepspeed" not in skipped:
        ds_op, why = _load_deepspeed(rank, world, port, dtype)
        if ds_op is None:
            skipped["deepspeed"] = why
    floor = None
    if "floor" not in skipped:
        link = _FloorLink(rank, world, port, max_numel * elem)
        floor = link.floor
        if floor is None:
            skipped["floor"] = link.why
    names = [n for n in NAMES if n not in skipped]

    def calls(t: torch.Tensor) -> dict[str, Callable[[], Any]]:
        """Each candidate's call on t (the timed form)."""
        every = {
            "ours_": lambda: ar.all_reduce_(t),
            "ours": lambda: ar.all_reduce(t),
            "streamed": lambda: small.all_reduce_(t),
            "deepspeed": lambda: ds_op(t),
            "gloo": lambda: dist.all_reduce(t),
            "floor": lambda: floor.run(t, t),
        }
        return {n: every[n] for n in names}

    def result_of(name: str, x: torch.Tensor) -> torch.Tensor:
        """Candidate's sum of x over the ranks, leaving x alone."""
        if name == "ours":
            return ar.all_reduce(x)
        y = x.clone()
        if name == "floor":
            floor.run(x, y)  # out of place here; timed in place
        else:
            calls(y)[name]()
        return y

    report: dict[str, Any] = {
        "sizes": sizes,
        "names": names,
        "skipped": skipped,
        "us": {},
        "ratio": {},
        "wrong": {},
        "iters": {},
        "tactic": {},
    }
    for size in sizes:
        numel = size // elem
        wrong = torch.zeros(len(names), dtype=torch.int64)
        for seed in (0, 1):  # two calls: both buffer sets / parities of every candidate
            x = rank_input(rank, numel, dtype, seed)
            for i, name in enumerate(names):
                dist.barrier()
                y = result_of(name, x)
                wrong[i] += count_wrong(y, world, numel, args.dtype_name, seed)
        dist.all_reduce(wrong)
        z = torch.zeros(numel, dtype=dtype)  # values never grow: no denormals or inf
        declined = ar.decline_reason(z)
        report["tactic"][size] = (
            f"fallback ({declined})" if declined is not None else ar.chosen_tactic(z)
        )
        fns = calls(z)
        iters: dict[str, int] = {}
        for name, fn in fns.items():  # warm up, then size the count to the time budget
            dist.barrier()
            _timed(fn, 5)
            per_call = _slowest(_timed(fn, MIN_ITERS))
            iters[name] = max(MIN_ITERS, min(MAX_ITERS, int(args.budget / max(per_call, 1e-9))))
        times: dict[str, list[float]] = {name: [] for name in fns}
        for round_ in range(args.rounds):
            k = round_ % len(names)
            for name in names[k:] + names[:k]:
                dist.barrier()
                times[name].append(_slowest(_timed(fns[name], iters[name])))
        report["us"][size] = {n: statistics.median(v) * 1e6 for n, v in times.items()}
        report["ratio"][size] = {
            n: statistics.median(a / b for a, b in zip(v, times[BASE]))
            for n, v in times.items()
            if BASE in times
        }
        report["wrong"][size] = dict(zip(names, wrong.tolist()))
        report["iters"][size] = iters
    ar.destroy()
    if small is not None:
        small.destroy()
    dist.barrier()
    if rank == 0:
        out_q.put(report)
    dist.destroy_process_group()


def _machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import importlib.metadata as md

        ds = md.version("deepspeed")
    except Exception:
        ds = "not installed"
    try:  # where the package lives and when its _C was built, without importing it here
        import glob
        import importlib.util

        where = os.path.dirname(importlib.util.find_spec("pcie_allreduce").origin)
        so = glob.glob(os.path.join(where, "_C*.so"))
        built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(so[0])))
        ours = f"at {where}, _C built {built}"
    except Exception:
        ours = "?"
    return (
        f"{os.cpu_count()} CPUs ({model}), torch {torch.__version__}, deepspeed {ds}, "
        f"pcie_allreduce {ours}"
    )


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _run_one(world: int, dtype_name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    args.dtype_name = dtype_name
    args.load_before = _loadavg()
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, out_q)) for r in range(world)]
    for proc in procs:
        proc.start()
    report = None
    try:
        while report is None:
            try:
                report = out_q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    print(
                        f"# world {world} {dtype_name}: a rank exited "
                        f"(exit codes {[p.exitcode for p in procs]})",
                        file=sys.stderr,
                    )
                    break
        for proc in procs:
            proc.join(timeout=None if report is not None else 5.0)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
        leftovers = [_floor_shm(port).lstrip("/")] + [_deepspeed_shm(port, r) for r in range(world)]
        for name in leftovers:
            path = os.path.join("/dev/shm", name)
            if os.path.exists(path):
                os.unlink(path)
                print(f"# removed leftover {path}", file=sys.stderr)
    return report


def _print_table(
    world: int, dtype_name: str, report: dict[str, Any], args: argparse.Namespace, wall_s: float
) -> None:
    names = report["names"]
    others = [n for n in names if n != BASE]
    print(f"\n### world {world}, {dtype_name}\n")
    print(f"- machine: {_machine()}")
    print(f"- command: {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(
        f"- median over {args.rounds} interleaved rounds of the slowest rank's mean us per "
        f"call (~{args.budget:g} s per candidate per round); x/{BASE}: median of per-round "
        f"ratios; verified against the float64 sum on 2 fresh inputs per size"
    )
    for name, why in report["skipped"].items():
        print(f"- {name}: skipped: {why}")
    print(
        f"- wall time: {wall_s:.1f} s; load average (1/5/15 min) before: {args.load_before}, "
        f"after: {_loadavg()} (other load on the machine distorts everything)\n"
    )
    head = (
        ["bytes"] + [f"{n} us" for n in names] + [f"{n}/{BASE}" for n in others] + ["ours tactic"]
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head[:-1]) + "|:---|")
    bad = []
    for size in report["sizes"]:
        us, ratio, wrong = report["us"][size], report["ratio"][size], report["wrong"][size]
        cells = [str(size)]
        for n in names:
            cells.append(f"{us[n]:.1f}" + (" !" if wrong[n] else ""))
            if wrong[n]:
                bad.append(f"{n} at {size} B: {wrong[n]} wrong elements (all ranks, 2 inputs)")
        cells += [f"{ratio[n]:.2f}" for n in others]
        cells.append(report["tactic"][size])
        print("| " + " | ".join(cells) + " |")
    for line in bad:
        print(f"- WRONG: {line}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--dtype", nargs="+", choices=["bf16", "fp32"], default=["bf16"])
    p.add_argument(
        "--sizes",
        nargs="+",
        type=_parse_bytes,
        help="message sizes in bytes (suffixes K, M), default 1K..16M by powers of 2",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--stream-workspace",
        type=_parse_bytes,
        default=1 << 20,
        help="the streamed candidate's workspace in bytes (default 1M)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.2,
        help="seconds per candidate per round (at least 3 calls)",
    )
    p.add_argument("--skip", nargs="*", default=[], choices=[n for n in NAMES if n != BASE])
    p.add_argument(
        "--quick", action="store_true", help="smoke run: sizes 1K 64K 1M, 3 rounds, 0.03 s budget"
    )
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.quick:
        args.sizes = args.sizes or [1 << 10, 1 << 16, 1 << 20]
        args.rounds, args.budget = 3, 0.03
    args.size_list = args.sizes or [1 << k for k in range(10, 25)]
    status = 0
    total = time.perf_counter()
    for world in args.world:
        for dtype_name in args.dtype:
            start = time.perf_counter()
            report = _run_one(world, dtype_name, args)
            if report is None:
                status = 1
                continue
            _print_table(world, dtype_name, report, args, time.perf_counter() - start)
            sys.stdout.flush()
            if any(any(w.values()) for w in report["wrong"].values()):
                status = 1
    print(f"\n- total wall time: {time.perf_counter() - total:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
