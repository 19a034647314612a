"""Choosing the CUDA transport when peer-to-peer fails, on real processes over a real gloo group.

Without a GPU the CUDA workspaces cannot be made, so each rank replaces exactly that layer: a
``_C.Communicator`` built for ``cuda`` or ``cuda_host`` is a real host-transport communicator
(real shared memory, real calls on CPU tensors) that records which transport was asked for,
and the P2P outcome is injected where the GPU would produce it (a connect that raises on one
rank, or a write-and-verify that finds a pair broken). Everything above that layer is the real
code: the gathers, the agreement, the switch to host memory, the tuning cache re-read for the
new fingerprint, stats() and destroy(). The GPU half is tests/gpu/hostmem_check.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import run_ranks

CONNECT_ERROR = (
    "cudaIpcOpenMemHandle of rank 0's workspace on rank 1 failed "
    "(cudaErrorPeerAccessUnsupported: peer access is not supported between these "
    "two devices)"
)


class _GpuStandIn:
    """A real host communicator standing in for a CUDA one; fails where P2P would."""

    def __init__(self, inner: Any, transport: str, rank: int, failure: str) -> None:
        self.inner, self.transport, self.rank, self.inject = inner, transport, rank, failure

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def connect(self, tokens: list[bytes]) -> None:
        if self.transport == "cuda_ipc" and self.inject == "connect" and self.rank == 1:
            raise RuntimeError(CONNECT_ERROR)
        self.inner.connect(tokens)

    def probe_read(self, nonce: int) -> list[int]:
        if self.transport == "cuda_ipc" and self.inject == "probe" and self.rank == 1:
            return [0]  # rank 0's writes did not arrive here
        return self.inner.probe_read(nonce)


def _stand_in_for_gpus(rank: int, failure: str) -> list[str]:
    """Installs the stand-in in this rank process; returns the list of transports made."""
    from pcie_allreduce import _C, construction

    made: list[str] = []
    real = _C

    class FakeC:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def Communicator(opts: Any) -> Any:  # noqa: N802 (the name it replaces)
            transport, device = opts.transport, opts.device
            made.append(transport)
            opts.transport, opts.device = "host", -1
            try:
                inner = real.Communicator(opts)
            finally:
                opts.transport, opts.device = transport, device
            return _GpuStandIn(inner, transport, rank, failure)

        @staticmethod
        def register_communicator(comm: Any) -> int:
            return real.register_communicator(getattr(comm, "inner", comm))

    construction._C = FakeC()
    torch.cuda.get_device_name = lambda device=None: "Stand-in GPU"
    return made


def _construct(
    rank: int, world: int, failure: str, transport: Any = None, check_call: bool = True
) -> dict[str, Any]:
    from pcie_allreduce import PcieAllReduce

    made = _stand_in_for_gpus(rank, failure)
    ar = PcieAllReduce(
        None,
        torch.device("cuda", 0),
        max_numel=8192,
        islands=[[0, 1]],
        transport=transport,
        timeout_s=20,
    )
    out: dict[str, Any] = {
        "made": list(made),
        "enabled": ar.enabled,
        "reason": ar.disabled_reason,
        "stats": ar.stats(),
        "fingerprint": ar.config.fingerprint,
        "fields": dict(ar.config.fingerprint_fields),
    }
    x = torch.full((6144,), float(rank + 1), dtype=torch.bfloat16)  # 12 KiB: a decode size
    out["tactic"] = ar.chosen_tactic(x)
    if check_call:
        y = ar.all_reduce(x)
        out["correct"] = bool(torch.equal(y, torch.full_like(x, sum(range(1, world + 1)))))
        out["kernel_calls"] = sum(v for k, v in ar.stats()["calls"].items() if k != "fallback")
    ar.destroy()
    return out


def test_a_failed_p2p_check_moves_every_rank_to_host_memory_and_says_why(clean_shm):
    results = run_ranks(_construct, 2, "probe").values()
    for r, res in enumerate(results):
        assert res["made"] == ["cuda_ipc", "cuda_host"], r  # tried P2P, then host memory
        assert res["enabled"], res["reason"]
        assert res["stats"]["transport"] == "cuda_host"
        assert res["stats"]["transport_detail"] == (
            "peer-to-peer failed: peer writes or reads did not arrive intact (rank 0 -> rank 1); "
            "every workspace is in shared pinned host memory"
        )
        assert res["stats"]["disabled_reason"] is None
        # Its own cache entry and its own table rows: the hostmem seed rows decide.
        assert (
            res["fields"]["transport"] == "cuda_host" and res["fields"]["topology"] == "cuda_host"
        )
        assert res["fingerprint"].startswith("cuda_host-w2-")
        assert res["tactic"].startswith("oneshot/push/unstaged/lamport/b8/"), res["tactic"]
        assert res["correct"] and res["kernel_calls"] == 1
    assert results[0]["fingerprint"] == results[1]["fingerprint"]


def test_a_peer_that_cannot_map_p2p_memory_is_named_and_every_rank_switches(clean_shm):
    results = run_ranks(_construct, 2, "connect").values()
    for res in results:
        assert res["made"] == ["cuda_ipc", "cuda_host"]
        assert res["stats"]["transport"] == "cuda_host" and res["enabled"]
        assert res["stats"]["transport_detail"] == (
            f"peer-to-peer failed: rank 1 cannot map its peers' workspaces ({CONNECT_ERROR}); "
            "every workspace is in shared pinned host memory"
        )
        assert res["correct"]


def test_transport_p2p_declines_no_p2p_instead_and_stays_correct(clean_shm):
    results = run_ranks(_construct, 2, "probe", "p2p").values()
    for res in results:
        assert res["made"] == ["cuda_ipc"]  # host memory was never tried
        assert not res["enabled"]
        assert res["reason"] == (
            "no_p2p: peer writes or reads did not arrive intact (rank 0 -> rank 1); check the "
            "IOMMU/ACS settings of the PCIe path between those GPUs (transport cuda_ipc: host "
            "memory was not tried)"
        )
        assert res["stats"]["transport"] == "cuda_ipc"
        assert res["tactic"] == "fallback"
        assert res["correct"] and res["kernel_calls"] == 0  # the group's own all-reduce


def test_working_p2p_stays_on_p2p(clean_shm):
    for res in run_ranks(_construct, 2, "none").values():
        assert res["made"] == ["cuda_ipc"] and res["enabled"]
        assert res["stats"]["transport"] == "cuda_ipc"
        assert res["stats"]["transport_detail"].startswith("peer-to-peer: every peer's GPU")
        assert res["fingerprint"].startswith("cuda_ipc-w2-")


@pytest.mark.parametrize("how", ["argument", "env"])
def test_hostmem_forces_host_memory_without_trying_p2p(how, clean_shm):
    env = {"PCIE_ALLREDUCE_TRANSPORT": "hostmem"} if how == "env" else {}
    results = run_ranks(
        _construct, 2, "probe", "hostmem" if how == "argument" else None, env=env
    ).values()
    source = "transport='cuda_host'" if how == "argument" else "PCIE_ALLREDUCE_TRANSPORT=cuda_host"
    for res in results:
        assert res["made"] == ["cuda_host"]  # the failing P2P probe never ran
        assert res["enabled"] and res["stats"]["transport"] == "cuda_host"
        assert res["stats"]["transport_detail"] == (
            f"{source}: every workspace in shared pinned host memory"
        )
        assert res["correct"]


def _ranks_disagree(rank: int, world: int) -> dict[str, Any]:
    return _construct(rank, world, "none", "hostmem" if rank == 0 else "auto")


def test_ranks_that_disagree_on_the_transport_turn_the_backend_off_everywhere(clean_shm):
    for res in run_ranks(_ranks_disagree, 2).values():
        assert not res["enabled"]
        # The first differing field names it: the transport, or the table key it implies.
        assert (
            "ranks disagree on transport" in res["reason"]
            or "rank 0 has 'cuda_host'" in res["reason"]
        ), res["reason"]
        assert res["correct"]


def _cache_after_switch(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    """Constructs once (P2P fails: host memory), has rank 0 write a tuning cache for the
    host-memory fingerprint, then constructs again: the switch must adopt that cache."""
    import torch.distributed as dist

    from pcie_allreduce.tuning import cache

    first = _construct(rank, world, "probe", check_call=False)
    if rank == 0:
        fp = first["fingerprint"]
        rows = (
            "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,"
            "threads,protocol\nhostmem,2,*,0,*,twoshot,push,0,2,64,flag\n"
        )
        cache.write_cache(cache.cache_path(fp), fp, first["fields"], rows, 1)
    dist.barrier()
    second = _construct(rank, world, "probe")
    return {"first": first, "second": second, "cache": str(cache.cache_path(second["fingerprint"]))}


def test_the_switch_reads_this_hosts_tuning_cache_for_host_memory(tmp_path, clean_shm):
    env = {"PCIE_ALLREDUCE_CACHE_DIR": str(tmp_path)}
    results = run_ranks(_cache_after_switch, 2, str(tmp_path), env=env).values()
    for res in results:
        assert res["first"]["stats"]["table_source"] == "embedded seed table"
        assert res["second"]["stats"]["table_source"] == f"cache {res['cache']}"
        assert res["second"]["tactic"].startswith("twoshot/push/unstaged/flag/b2/"), res["second"][
            "tactic"
        ]
        assert res["second"]["correct"]
    assert os.path.basename(results[0]["cache"]).startswith("cuda_host-w2-")
