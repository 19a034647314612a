"""Two ranks that construct a communicator and all-reduce with numpy made unimportable
(test_reliability.py runs this file): the package must not need numpy."""

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # before torch is imported anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def rank_main(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=4096)
    out = ar.all_reduce(torch.full((1024,), float(rank + 1)))
    ok = ar.enabled and out.eq(3).all().item()
    print(
        f"rank {rank} no numpy: {'enabled' if ar.enabled else 'disabled'}, sum "
        f"{'ok' if ok else 'wrong'}",
        flush=True,
    )
    ar.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
