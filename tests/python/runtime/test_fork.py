"""A child forked from a rank cannot use the rank's communicator. Its peers
know only the parent as that rank; a child accepted in its place would race the parent on the
same slots and flags. Real processes, a real gloo group, the host transport."""

from __future__ import annotations

import os

import torch
from conftest import run_ranks


def _in_child(fn) -> str:
    """Runs fn in a forked child and returns what it said (or the exception it raised)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's exit handlers
        try:
            said = f"returned {fn()!r}"
        except BaseException as error:  # noqa: BLE001 - the child reports whatever it met
            said = f"{type(error).__name__}: {error}"
        os.write(write_end, said.encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def _a_forked_child_is_refused(rank, world):
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=5.0)
    before = float(ar.all_reduce(torch.full((256,), float(rank + 1)))[0])
    child = {}
    if rank == 0:
        # Its peer is not in a call: a child accepted as rank 0 would wait out the timeout (or,
        # with the peer in a call, take its data); refused, it says so at once.
        child["out_of_place"] = _in_child(lambda: ar.all_reduce(torch.ones(256)))
        child["in_place"] = _in_child(lambda: ar.all_reduce_(torch.ones(256)))
        child["prepare"] = _in_child(ar.prepare)
        # destroy() in the child touches nothing its parent still uses.
        child["destroy"] = _in_child(ar.destroy)
    torch.distributed.barrier()
    after = float(ar.all_reduce(torch.full((256,), 10.0 * (rank + 1)))[0])
    ar.destroy()
    return {"before": before, "after": after, "child": child, "pid": os.getpid()}


def test_a_forked_child_cannot_use_its_parents_communicator(clean_shm):
    res = run_ranks(_a_forked_child_is_refused, 2, timeout=120).values()
    assert [r["before"] for r in res] == [3.0, 3.0], res
    child = res[0]["child"]
    for what in ("out_of_place", "in_place", "prepare"):
        said = child[what]
        assert said.startswith("RuntimeError"), (what, said)
        assert f"created in process {res[0]['pid']}" in said, (what, said)
        assert "child forked from it" in said and "spawn" in said, (what, said)
    assert child["destroy"] == "returned None", child
    # The parent kept its rank: the next call sums both ranks, nothing from the child.
    assert [r["after"] for r in res] == [30.0, 30.0], res
