"""Device check of the tuner: two ranks share the one GPU (loopback, gloo group), tune bf16 up
to 64 KiB under CUDA-graph replay, print the chosen tactics beside the incumbent (the seed's
estimate) and the fallback, then check that a second communicator loads the cache and that a
second tune measures nothing. Loopback ranks peers as local L2: read the table as what the
tuner does, not as what a PCIe host would choose."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import two_ranks


def body(rank: int, world: int) -> list[str]:
    from pcie_allreduce import PcieAllReduce

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    lines = []
    with PcieAllReduce(None, dev, max_numel=1 << 15) as ar:
        report = ar.tune(
            dtypes=["bf16"], max_bytes=64 << 10, budget_s=90, force=True, progress=False
        )
        lines.append(
            f"measured {report['measured']} pairs in {report['seconds']:.1f} s -> {report['path']}"
        )
        for c in report["choices"]:
            lines.append(
                f"  {c['op']:<14} {c['bytes']:>6} B  incumbent {c['incumbent']:<36} "
                f"{c['incumbent_us']:7.2f} us  chosen {c['winner']:<36} "
                f"{c['time_us']:7.2f} us  fallback {c['fallback_us']:8.2f} us  "
                f"noise {c['noise_pct']:.2f}%"
            )
        for bad in report["excluded"]:
            lines.append(f"FAIL wrong result: {bad}")
    with PcieAllReduce(None, dev, max_numel=1 << 15) as again:
        source = again.stats()["table_source"]
        second = again.tune(dtypes=["bf16"], max_bytes=64 << 10, progress=False)
        ok = "cache" in source and second["measured"] == 0 and second["status"] == "cached"
        lines.append(
            f"{'ok' if ok else 'FAIL'} reopened from {source}; second tune "
            f"{second['status']}, measured {second['measured']}"
        )
    return lines


def main() -> int:
    out = os.environ.get("OUT", tempfile.gettempdir())
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = os.path.join(out, "tune_cache")  # the ranks inherit it
    return two_ranks.run(body, "tune check", world=2, timeout_s=240)


if __name__ == "__main__":
    sys.exit(main())
