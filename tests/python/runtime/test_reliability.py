"""The reliability rules, each tried: bounded construction that names the missing rank,
destroy() that never waits for a failed peer, PCIE_ALLREDUCE_ENABLE, multi-host groups, no
numpy, the autograd and inference-mode rules for written tensors, and argument errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_ranks

HERE = Path(__file__).resolve().parent


def _timeout_error(res, rank):
    return res[rank]["type"] == "PcieAllReduceTimeout" and res[rank]["attrs"]["diagnostic"]


# --------------------------------------------------------------------- bounded construction
def _one_rank_fails_before_the_handshake(rank, world, failure):
    from pcie_allreduce import PcieAllReduce, communicator

    if rank == 1 and failure == "table":
        os.environ["PCIE_ALLREDUCE_TABLE"] = "/nonexistent/pcie_allreduce_table.csv"
    if rank == 1 and failure == "shm":

        def no_shm(*args, **kwargs):
            raise OSError("shm_open: No space left on device (simulated on rank 1)")

        communicator._C.Communicator = no_shm
    start = time.monotonic()
    try:
        PcieAllReduce(None, "cpu", max_numel=4096, timeout_s=1.0)
    except Exception as error:
        if rank == 1:
            time.sleep(3.0)  # the failed rank lives on, as a server process would
        error.elapsed = time.monotonic() - start
        raise
    return "constructed"


@pytest.mark.parametrize("failure", ["table", "shm"])
def test_a_rank_failing_during_construction_is_named_by_the_others_within_the_timeout(
    failure, clean_shm
):
    res = run_ranks(
        _one_rank_fails_before_the_handshake, 3, failure, allow_failures=True, timeout=60
    )
    assert res[1]["type"] == ("FileNotFoundError" if failure == "table" else "OSError")
    if failure == "table":
        assert "PCIE_ALLREDUCE_TABLE" in res[1]["error"] and "does not exist" in res[1]["error"]
    for r in (0, 2):
        assert res[r]["type"] == "PcieAllReduceTimeout", res[r]
        diagnostic = res[r]["attrs"]["diagnostic"]
        assert diagnostic["missing"] == [1], diagnostic
        assert "rank 1" in res[r]["error"] and "1 s" in res[r]["error"]
        assert res[r]["attrs"]["elapsed"] < 2.5  # the 1 s timeout plus spawn-time skew
        assert diagnostic["stage"] == ("meet" if failure == "table" else "connect")


# --------------------------------------------------------------------- destroy after a failure
def _destroy_after_peer_failure(rank, world):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    ar = PcieAllReduce(None, "cpu", max_numel=4096, timeout_s=2.0)
    if rank == 0:
        with pytest.raises(PcieAllReduceTimeout):
            ar.all_reduce(torch.ones(1024))  # rank 1 never calls
    else:
        time.sleep(3.0)
    start = time.monotonic()
    ar.destroy()
    waited = time.monotonic() - start
    # Re-creating on the same group works (it deadlocked before), and rank 0's next destroy()
    # skips the farewell rank 1 sent to the failed communicator.
    sums = []
    for _ in range(2):
        ar = PcieAllReduce(None, "cpu", max_numel=4096, timeout_s=5)
        sums.append(ar.all_reduce(torch.full((1024,), float(rank + 1)))[0].item())
        ar.destroy()
    return waited, sums


def test_destroy_never_waits_for_a_peer_that_failed_and_recreating_works(clean_shm):
    results = run_ranks(_destroy_after_peer_failure, 2, timeout=60).values()
    # Before: rank 1's destroy() waited in a barrier rank 0 had skipped, for gloo's timeout.
    # Waiting out its own 2 s timeout would mean it never heard rank 0's farewell.
    assert max(waited for waited, _ in results) < 1.0, results
    assert all(sums == [3.0, 3.0] for _, sums in results), results


# --------------------------------------------------------------------- PCIE_ALLREDUCE_ENABLE
def _disabled_by_env(rank, world):
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=4096)
    x = torch.full((1024,), float(rank + 1))
    out = ar.all_reduce(x)
    result = (
        ar.enabled,
        ar.disabled_reason,
        ar.decline_reason(x),
        out[0].item(),
        ar.stats()["declines"],
    )
    ar.destroy()
    return result


def test_enable_0_turns_the_kernels_off_everywhere(clean_shm):
    for enabled, reason, decline, value, declined in run_ranks(
        _disabled_by_env, 2, env={"PCIE_ALLREDUCE_ENABLE": "0"}
    ).values():
        assert not enabled and reason == "disabled: PCIE_ALLREDUCE_ENABLE=0"
        assert decline == "disabled" and value == 3.0 and declined.get("disabled") == 1


def test_enable_unset_means_library_on_integrations_off_and_1_means_both_on():
    from pcie_allreduce.env import integrations_enabled, read_env

    assert read_env({}).enable is None and not integrations_enabled({})
    assert read_env({"PCIE_ALLREDUCE_ENABLE": "0"}).enable is False
    assert not integrations_enabled({"PCIE_ALLREDUCE_ENABLE": "0"})
    assert integrations_enabled({"PCIE_ALLREDUCE_ENABLE": "1"})


# --------------------------------------------------------------------- multi-host groups
def _two_hosts(rank, world):
    from pcie_allreduce import PcieAllReduce, construction

    if rank == 1:
        construction.host_identity = lambda: "other-node/6f1c"
    ar = PcieAllReduce(None, "cpu", max_numel=4096)
    x = torch.full((1024,), float(rank + 1))
    result = (ar.enabled, ar.disabled_reason, ar.all_reduce(x)[0].item(), ar.workspace_bytes)
    ar.destroy()
    return result


def test_a_group_spanning_hosts_declines_multi_host_and_stays_correct(clean_shm):
    for enabled, reason, value, workspace in run_ranks(_two_hosts, 2).values():
        assert not enabled and reason.startswith("multi_host: rank 0 runs on ")
        assert "rank 1 on other-node/6f1c" in reason
        assert value == 3.0 and workspace == 0  # no segment was ever created


# --------------------------------------------------------------------- no numpy
def test_construction_and_calls_work_without_numpy(tmp_path, clean_shm):
    script = HERE / "no_numpy_ranks.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "init")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("no numpy: enabled, sum ok") == 2, done.stdout + done.stderr


# --------------------------------------------------------------------- autograd / inference
def _written_tensor_rules(rank, world):
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=4096)
    errors = {}
    leaf = torch.ones(1024, requires_grad=True)
    rows = torch.ones(4, 256)
    leaf_rows = torch.ones(4, 256, requires_grad=True)
    fused = ar.all_reduce_add_rms_norm
    for name, call in {
        "leaf_in_place": lambda: ar.all_reduce_(leaf),
        "non_leaf_in_place": lambda: ar.all_reduce_(leaf * 2),
        "out_requires_grad": lambda: ar.all_reduce(torch.ones(1024), out=leaf),
        "fused_residual_out": lambda: fused(
            rows, rows.clone(), rows[0], 1e-6, residual_out=leaf_rows
        ),
        "fused_out_x": lambda: fused(leaf_rows, rows, rows[0], 1e-6, out=leaf_rows),
    }.items():
        with pytest.raises(RuntimeError) as info:
            call()
        errors[name] = str(info.value)
    assert leaf.detach().eq(1).all() and leaf_rows.detach().eq(1).all()  # not written
    with torch.inference_mode():
        inference = torch.ones(1024)
    with pytest.raises(RuntimeError) as info:
        ar.all_reduce_(inference)
    errors["inference"] = str(info.value)
    with torch.no_grad():  # what torch's own in-place ops allow, and the sum is right
        ar.all_reduce_(leaf)
    with torch.inference_mode():
        ar.all_reduce_(inference)
    out_of_place = ar.all_reduce(leaf)  # reading a tensor that requires grad is fine
    sums = (leaf[0].item(), inference[0].item(), out_of_place[0].item())
    ar.destroy()
    for out in (None, torch.empty(1024)):  # out= used to run the fallback after destroy()
        with pytest.raises(ValueError, match="was it destroyed"):
            ar.all_reduce(torch.ones(1024), out=out)
    return errors, sums


def test_written_tensors_follow_torchs_autograd_and_inference_mode_rules(clean_shm):
    for errors, sums in run_ranks(_written_tensor_rules, 2).values():
        assert "leaf Variable that requires grad" in errors["leaf_in_place"]
        assert "has no derivative" in errors["non_leaf_in_place"]
        assert "all_reduce(out=)" in errors["out_requires_grad"]
        assert (
            "all_reduce_add_rms_norm(residual_out=) has no derivative, but residual_out"
            in (errors["fused_residual_out"])
        )
        assert "all_reduce_add_rms_norm(out=x)" in errors["fused_out_x"]
        assert "inference tensor outside InferenceMode" in errors["inference"]
        assert sums == (2.0, 2.0, 4.0)


# --------------------------------------------------------------------- argument errors
def _bad_arguments(rank, world, table_dir):
    from pcie_allreduce import PcieAllReduce

    binary = Path(table_dir) / "binary.csv"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    empty = Path(table_dir) / "empty.csv"
    empty.write_text("")
    comments = Path(table_dir) / "comments.csv"
    comments.write_text("# measured nothing yet\n\n")
    cases = {
        "timeout_nan": dict(timeout_s=math.nan),
        "timeout_inf": dict(timeout_s=math.inf),
        "timeout_negative": dict(timeout_s=-1),
        "max_numel_fraction": dict(max_numel=1024.5),
        "max_numel_bool": dict(max_numel=True),
        "hidden_fraction": dict(hidden=8192.5, max_rows=4),
        "table_empty_string": dict(table=""),
        "table_missing": dict(table="/nonexistent/table.csv"),
        "table_directory": dict(table=table_dir),
        "table_binary": dict(table=str(binary)),
        "table_empty_file": dict(table=str(empty)),
        "table_comments_only": dict(table=str(comments)),
        "table_blocks_overflow": dict(table="*,*,*,0,*,oneshot,push,1,2147483648,512"),
        "table_world_overflow": dict(table="*,4294967298,*,0,*,oneshot,push,1,1,512"),
        "transport_unknown": dict(transport="nvlink"),
        "transport_on_cpu": dict(transport="hostmem"),
    }
    errors = {}
    for name, kwargs in cases.items():
        if "hidden" not in kwargs:
            kwargs.setdefault("max_numel", 4096)
        try:
            PcieAllReduce(None, "cpu", **kwargs).destroy()
            errors[name] = None
        except Exception as error:  # every case must raise before any exchange
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def test_bad_constructor_arguments_say_what_was_wrong_and_what_was_expected(tmp_path):
    errors = run_ranks(_bad_arguments, 1, str(tmp_path)).values()[0]
    expected = {
        "timeout_nan": "finite number of seconds >= 0",
        "timeout_inf": "finite number of seconds >= 0",
        "timeout_negative": "finite number of seconds >= 0",
        "max_numel_fraction": "max_numel must be a whole number, got 1024.5",
        "max_numel_bool": "max_numel must be a whole number, got True",
        "hidden_fraction": "hidden must be a whole number",
        "table_empty_string": "table must be CSV text or a path",
        "table_missing": "does not exist; expected a tuning-table CSV file",
        "table_directory": "is a directory",
        "table_binary": "is not a text tuning table",
        "table_empty_file": "the table has no rows",
        "table_comments_only": "the table has no rows",
        "table_blocks_overflow": "column blocks must be an integer in 1..2147483647, got "
        "'2147483648' (out of range)",
        "table_world_overflow": "column world must be an integer in",
        "transport_unknown": "transport must be one of auto, host_shm, cuda_ipc, cuda_host (or "
        "host = host_shm, cuda = cuda_ipc, p2p = cuda_ipc, hostmem = cuda_host), got 'nvlink'",
        "transport_on_cpu": "transport='hostmem' chooses how GPUs reach each other; this "
        "communicator is on cpu (CPU tensors use POSIX shared memory): pass transport=None",
    }
    for name, fragment in expected.items():
        assert errors[name] is not None and fragment in errors[name], (name, errors[name])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--world", "0"], "--world must be in 2..8, got 0"),
        (["--min-bytes", "1", "--max-bytes", "15"], "no message size in --min-bytes 1"),
        (["--json", "/nonexistent/dir/out.json"], "does not exist or is not writable"),
        (["--table", "/nonexistent/table.csv"], "no such file"),
        (
            ["--transport", "nvlink"],
            "--transport must be one of auto, host_shm, cuda_ipc, "
            "cuda_host (or host = host_shm, cuda = cuda_ipc, p2p = cuda_ipc, hostmem = cuda_host), "
            "got 'nvlink'",
        ),
    ],
)
def test_bench_rejects_bad_arguments_before_starting_any_rank(argv, fragment, capsys):
    from pcie_allreduce.cli import main

    assert main(["bench", "--transport", "host", *argv]) == 2
    assert fragment in capsys.readouterr().err
