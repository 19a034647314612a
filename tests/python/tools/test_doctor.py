"""`pcie-allreduce doctor`: recorded hosts (fixtures), the P2P result parsing and cache, the
IOMMU hints, the tuning-cache report, and one live run of this GPU-less machine."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from pcie_allreduce import _C, plan, policy
from pcie_allreduce.tools import doctor
from pcie_allreduce.tools.doctor import (
    host_transport,
    inventory,
    iommu,
    p2p,
    system,
    tables,
    verdict,
)
from pcie_allreduce.topology import host_devices
from pcie_allreduce.tuning import cache

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus" / "fuzz_nvidia_smi_topo"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pcie-allreduce")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor.add_parser(sub)
    return parser.parse_args(["doctor", *argv])


def run_doctor(capsys: Any, *argv: str) -> tuple[int, str, str]:
    args = parse(list(argv))
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_doctor(capsys, "--json", *argv)
    assert err == ""
    return code, json.loads(out)  # exactly one JSON object, nothing else


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


def fixture_with_transport(name: str, tmp_path: Path, transport: str) -> Path:
    """A copy of a recorded host whose environment sets PCIE_ALLREDUCE_TRANSPORT (a fixture's
    environment is its ``env`` file, never this process's)."""
    dest = copy_fixture(name, tmp_path)
    (dest / "env").write_text(f"PCIE_ALLREDUCE_TRANSPORT={transport}\n")
    return dest


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test reads or writes the caller's own tuning cache or sees their table."""
    cache = tmp_path / "live-cache"
    monkeypatch.setenv("PCIE_ALLREDUCE_CACHE_DIR", str(cache))
    monkeypatch.delenv("PCIE_ALLREDUCE_TABLE", raising=False)
    monkeypatch.delenv("PCIE_ALLREDUCE_ENABLE", raising=False)
    monkeypatch.delenv("PCIE_ALLREDUCE_TRANSPORT", raising=False)
    return cache


# ---------------------------------------------------------------------------- recorded hosts


def test_two_socket_pcie_host_can_run_with_island_algorithms(capsys):
    code, report = run_json(capsys, "--fixture", str(FIXTURES / "two_socket_8gpu"))
    assert code == 0 and report["ok"] is True
    assert report["gpus"]["count"] == 8 and report["gpus"]["probe"] == "nvidia-smi"
    assert [g["numa_node"] for g in report["gpus"]["devices"]] == [0] * 4 + [1] * 4
    assert report["gpus"]["devices"][5]["bus_id"] == "0000:a1:00.0"
    assert report["topology"]["islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report["topology"]["table_key"] == "islands-2x4"
    assert report["p2p"]["status"] == "ok" and len(report["p2p"]["pairs"]) == 8 * 7
    assert {"island_oneshot", "island_twoshot"} <= set(report["tactics"]["available"])
    assert report["iommu"]["mode"] == "passthrough" and report["iommu"]["hints"] == []
    assert report["declines"] == []
    assert report["transport"]["name"] == "cuda_ipc" and report["transport"]["mode"] == "auto"
    assert report["table"]["gpu_cache"]["fingerprint"].startswith("cuda_ipc-w8-")
    verdict = report["verdict"]
    assert verdict.startswith("pcie_allreduce can run here: ")
    assert "islands-2x4" in verdict and "2 islands of 4" in verdict and "56 pairs" in verdict
    assert "island_twoshot" in verdict


def test_nvlink_host_declines_and_skips_the_p2p_test(capsys):
    code, report = run_json(capsys, "--fixture", str(FIXTURES / "dgx_nvlink_8gpu"))
    assert code == 1 and report["ok"] is False
    assert report["topology"]["has_nvlink"] is True
    assert [d["reason"] for d in report["declines"]] == ["nvlink"]
    assert "nvlink" in report["verdict"].lower()
    assert report["p2p"]["status"] == "skipped"


def test_failing_p2p_pairs_decline_no_p2p_with_transport_p2p(capsys, tmp_path):
    fixture = fixture_with_transport("p2p_blocked_4gpu", tmp_path, "p2p")
    recorded = json.loads((fixture / "p2p.json").read_text())["failing"]
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and report["ok"] is False
    assert sorted(report["p2p"]["failing"]) == sorted(recorded)
    failed = {(p["src"], p["dst"]) for p in report["p2p"]["pairs"] if p["status"] == "failed"}
    assert failed == {tuple(p) for p in recorded}
    assert [d["reason"] for d in report["declines"]] == ["no_p2p"]
    assert report["verdict"].startswith("pcie_allreduce cannot run here")
    assert "PCIE_ALLREDUCE_TRANSPORT=cuda_ipc" in report["verdict"]
    assert report["transport"]["name"] == "cuda_ipc" and report["transport"]["mode"] == "cuda_ipc"
    assert report["table"]["gpu_cache"]["fingerprint"].startswith("cuda_ipc-w4-")
    for writer, reader in recorded:
        assert f"GPU{writer} -> GPU{reader}" in report["verdict"]
    assert "GPU0 -> GPU1" not in report["verdict"]  # the pair behind one switch works
    assert any("PCIe switch" in h and "ACS" in h for h in report["iommu"]["hints"])


def test_failing_p2p_pairs_move_to_host_memory_in_auto_mode(capsys):
    fixture = FIXTURES / "p2p_blocked_4gpu"
    recorded = json.loads((fixture / "p2p.json").read_text())["failing"]
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["ok"] is True
    assert report["declines"] == []  # host memory is not a decline
    assert report["transport"]["name"] == "cuda_host" and report["transport"]["mode"] == "auto"
    assert report["p2p"]["status"] == "failed"  # the P2P section still names the pairs
    assert sorted(report["p2p"]["failing"]) == sorted(recorded)
    verdict = report["verdict"]
    assert verdict.startswith(
        "pcie_allreduce can run here over shared pinned host memory (transport cuda_host)"
    )
    for writer, reader in recorded:
        assert f"GPU{writer} -> GPU{reader}" in verdict
        assert f"GPU{writer} -> GPU{reader}" in report["transport"]["detail"]
    assert "GPU0 -> GPU1" not in verdict
    assert "slower per call than P2P" in verdict and "PCIe round trip" in verdict
    assert "IOMMU/ACS" in verdict and "restores P2P" in verdict
    assert "no_p2p" not in [d["reason"] for d in report["declines"]]
    # The cache the communicator reads on host memory, not the P2P one.
    assert report["table"]["gpu_cache"]["fingerprint"].startswith("cuda_host-w4-")
    iommu = report["iommu"]
    assert iommu["mode"] == "translated" and "intel_iommu=on" in iommu["cmdline_flags"]
    assert iommu["groups"] == 12 and iommu["group_types"] == {"DMA-FQ": 12}
    assert any("iommu=pt" in h and "without passthrough" in h for h in iommu["hints"])
    assert any("PCIe switch" in h and "ACS" in h for h in iommu["hints"])


def test_single_gpu_host_has_nothing_to_reduce_with(capsys):
    code, report = run_json(capsys, "--fixture", str(FIXTURES / "single_gpu"))
    assert code == 1 and report["ok"] is False
    assert report["gpus"]["count"] == 1
    assert report["p2p"]["status"] == "not_applicable"
    assert "1 GPU" in report["verdict"] and "nothing to do" in report["verdict"]
    assert report["tactics"]["available"] == []


def test_no_gpu_fixture_reports_the_recorded_host_transport(capsys, tmp_path):
    code, report = run_json(capsys, "--fixture", str(FIXTURES / "no_gpu"))
    assert code == 0 and report["ok"] is True
    assert report["gpus"]["count"] == 0 and report["host_transport"]["status"] == "ok"
    assert "no GPU found" in report["verdict"]

    broken = copy_fixture("no_gpu", tmp_path)
    (broken / "host_transport.json").write_text(
        json.dumps({"ok": False, "detail": "shm_open: Permission denied"})
    )
    code, report = run_json(capsys, "--fixture", str(broken))
    assert code == 1 and report["ok"] is False
    assert "Permission denied" in report["verdict"] and "no GPU found" in report["verdict"]


def test_text_mode_prints_sections_and_the_verdict_last(capsys, tmp_path):
    code, out, _ = run_doctor(capsys, "--fixture", str(FIXTURES / "p2p_blocked_4gpu"))
    assert code == 0
    for heading in (
        "GPUs (nvidia-smi",
        "Topology",
        "P2P write-and-verify",
        "Transport",
        "IOMMU / ACS",
        "Tuning table",
        "Tactics (world 4)",
    ):
        assert heading in out
    assert "NVIDIA L40S" in out
    assert "\nTransport\n  cuda_host (mode auto): P2P failed on GPU0 -> GPU2" in out
    last = out.rstrip("\n").splitlines()[-1]
    assert last.startswith("verdict: pcie_allreduce can run here over shared pinned host memory")

    code, out, _ = run_doctor(
        capsys, "--fixture", str(fixture_with_transport("p2p_blocked_4gpu", tmp_path, "p2p"))
    )
    assert code == 1
    assert "\nTransport\n  cuda_ipc (mode cuda_ipc): P2P failed on" in out
    assert out.rstrip("\n").splitlines()[-1].startswith("verdict: pcie_allreduce cannot run here")


def test_forced_host_memory_uses_cuda_host_even_where_p2p_works(capsys, tmp_path):
    fixture = fixture_with_transport("two_socket_8gpu", tmp_path, "hostmem")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["ok"] is True and report["declines"] == []
    assert report["p2p"]["status"] == "ok"
    assert report["transport"]["name"] == "cuda_host"
    assert report["transport"]["mode"] == "cuda_host"
    assert "forced" in report["transport"]["detail"]
    verdict = report["verdict"]
    assert (
        "transport cuda_host" in verdict
        and "forced by PCIE_ALLREDUCE_TRANSPORT=cuda_host" in verdict
    )
    assert "slower per call than P2P" in verdict and "island_twoshot" in verdict
    assert report["table"]["gpu_cache"]["fingerprint"].startswith("cuda_host-w8-")

    # Forced host memory never tries P2P: a failing pair does not block either.
    fixture = fixture_with_transport("p2p_blocked_4gpu", tmp_path / "blocked", "hostmem")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["declines"] == []
    assert report["transport"]["name"] == "cuda_host"
    assert "forced by PCIE_ALLREDUCE_TRANSPORT=cuda_host" in report["verdict"]


def test_a_bad_transport_setting_blocks_because_communicators_raise(capsys, tmp_path):
    fixture = fixture_with_transport("two_socket_8gpu", tmp_path, "nvlink-please")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and report["ok"] is False
    assert [d["reason"] for d in report["declines"]] == ["transport"]
    assert "nvlink-please" in report["verdict"] and "PCIE_ALLREDUCE_TRANSPORT" in report["verdict"]
    assert report["transport"]["mode"] == "invalid"

    fixture = fixture_with_transport("no_gpu", tmp_path / "cpu", "nvlink-please")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and "nvlink-please" in report["verdict"]
    assert report["transport"]["name"] == "host_shm"


def test_the_live_system_reads_the_transport_from_the_environment(monkeypatch):
    assert verdict.transport_mode(system.LiveSystem().env) == ("auto", None)
    monkeypatch.setenv("PCIE_ALLREDUCE_TRANSPORT", " P2P ")
    assert verdict.transport_mode(system.LiveSystem().env) == ("cuda_ipc", None)
    monkeypatch.setenv("PCIE_ALLREDUCE_TRANSPORT", "hostmem")
    assert verdict.transport_mode(system.LiveSystem().env) == ("cuda_host", None)
    monkeypatch.setenv("PCIE_ALLREDUCE_TRANSPORT", "ipc")
    mode, error = verdict.transport_mode(system.LiveSystem().env)
    assert error is not None and "'ipc'" in error


def test_fixture_without_p2p_record_is_not_tested_and_no_p2p_test_flag_is_accepted(
    capsys, tmp_path
):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "p2p.json").unlink()
    for argv in ([], ["--no-p2p-test"]):
        code, report = run_json(capsys, "--fixture", str(fixture), *argv)
        assert code == 0 and report["p2p"]["status"] == "not_tested"
        assert "P2P not tested" in report["verdict"]


def test_topology_fallback_to_nvidia_smi_numa_column(capsys, tmp_path):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "numa_nodes").unlink()  # sysfs unknown: nvidia-smi's NUMA Affinity column
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0
    assert [g["numa_node"] for g in report["gpus"]["devices"]] == [0] * 4 + [1] * 4


@pytest.mark.parametrize(
    "corpus_file", ["uneven_3_5_8gpu.txt", "switch_pairs_8gpu.txt", "single_socket_2gpu.txt"]
)
def test_other_recorded_topologies_agree_with_the_topology_object(capsys, tmp_path, corpus_file):
    text = (CORPUS / corpus_file).read_text()
    topo = _C.Topology.from_nvidia_smi(text)
    fixture = tmp_path / "host"
    fixture.mkdir()
    (fixture / "nvidia_smi_topo.txt").write_text(text)
    (fixture / "p2p.json").write_text('{"failing": []}')
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0
    assert report["topology"]["table_key"] == topo.table_key()
    assert report["topology"]["islands"] == [list(i) for i in topo.islands()]
    island_of = list(topo.island_of()) if len(topo.islands()) > 1 else []
    expect = [a for a in plan.ALGORITHMS if _C.why_unsupported(a, topo.world, island_of) is None]
    assert report["tactics"]["available"] == expect
    assert report["gpus"]["problems"]  # no query_gpu.csv: names unknown, said so


def test_unparsable_topology_blocks_and_is_not_p2p_tested(capsys, tmp_path):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "p2p.json").unlink()
    text = (fixture / "nvidia_smi_topo.txt").read_text()
    (fixture / "nvidia_smi_topo.txt").write_text(text.replace("PHB", "FOO", 1))
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and report["p2p"]["status"] == "skipped"
    assert [d["reason"] for d in report["declines"]] == ["topology"]
    assert "FOO" in report["verdict"] and report["gpus"]["count"] == 8


def test_more_than_eight_gpus_can_run_in_groups_of_eight(capsys, tmp_path):
    classes = [
        ["X" if a == b else ("NODE" if a // 8 == b // 8 else "SYS") for b in range(16)]
        for a in range(16)
    ]
    fixture = tmp_path / "host"
    fixture.mkdir()
    (fixture / "nvidia_smi_topo.txt").write_text(inventory.topo_text_from_classes(classes))
    (fixture / "p2p.json").write_text('{"failing": []}')
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["gpus"]["count"] == 16
    assert len(report["p2p"]["pairs"]) == 8 * 7  # the test covers the first 8 GPUs
    assert [d["reason"] for d in report["declines"]] == ["world_size"]
    assert "world_size" in report["verdict"] and "islands-2x8" in report["verdict"]


def test_environment_notes_and_untested_host_transport(capsys, tmp_path):
    fixture = copy_fixture("no_gpu", tmp_path)
    (fixture / "env").write_text("PCIE_ALLREDUCE_ENABLE=0\n")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and "PCIE_ALLREDUCE_ENABLE=0" in report["verdict"]
    (fixture / "host_transport.json").unlink()
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and report["host_transport"]["status"] == "not_tested"


@pytest.mark.parametrize(
    "setup, message",
    [
        (None, "is not a directory"),
        ("empty", "none of the recorded files"),
        ("bad_json", "p2p.json"),
        ("bad_pairs", "'failing' must list"),
        ("bad_env", "KEY=VALUE"),
    ],
)
def test_bad_fixture_directory_is_a_usage_error(capsys, tmp_path, setup, message):
    fixture = tmp_path / "missing"
    if setup is not None:
        fixture = copy_fixture("two_socket_8gpu", tmp_path)
        if setup == "empty":
            shutil.rmtree(fixture)
            fixture.mkdir()
        elif setup == "bad_json":
            (fixture / "p2p.json").write_text("{not json")
        elif setup == "bad_pairs":
            (fixture / "p2p.json").write_text('{"failing": [[0, 8]]}')
        elif setup == "bad_env":
            (fixture / "env").write_text("PCIE_ALLREDUCE_TABLE\n")
    code, out, err = run_doctor(capsys, "--json", "--fixture", str(fixture))
    assert code == 2 and out == ""
    assert message in err


# ---------------------------------------------------------------------------- tuning table


def write_valid_cache(path: Path, fp: str, fields: dict[str, Any]) -> None:
    rows = (
        "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads\n"
        "*,*,*,0,*,fallback,,,,\n"
    )
    cache.write_cache(path, fp, fields, rows, measured=1)


def test_host_cache_report_tells_valid_foreign_and_corrupt(private_cache):
    devices = host_devices()

    def fields(world: int) -> dict[str, Any]:
        return policy.fingerprint_fields("host", world, "host", [], devices, "")

    valid_fp = policy.fingerprint(fields(2))
    write_valid_cache(cache.cache_path(valid_fp), valid_fp, fields(2))
    corrupt_fp = policy.fingerprint(fields(4))
    corrupt = cache.cache_path(corrupt_fp)
    write_valid_cache(corrupt, corrupt_fp, fields(4))
    corrupt.write_text(corrupt.read_text().replace("fallback", "fallbacc"))
    other = policy.fingerprint_fields("host", 3, "host", [], ["another CPU"], "")
    foreign = private_cache / "host_shm-w3-000000000000.csv"
    write_valid_cache(foreign, policy.fingerprint(other), other)

    table = tables.table_report(system.LiveSystem(), None)
    status = {c["world"]: c["status"] for c in table["host_caches"]}
    assert status == {2: "valid", 3: "foreign", 4: "corrupt"}
    assert str(cache.cache_path(valid_fp)) in table["in_use"]
    assert "checksum" in next(c["problem"] for c in table["host_caches"] if c["world"] == 4)


@pytest.mark.parametrize(
    "name, transport", [("two_socket_8gpu", "hostmem"), ("p2p_blocked_4gpu", "auto")]
)
def test_gpu_cache_on_host_memory_is_the_cuda_host_one(capsys, tmp_path, name, transport):
    """Where the communicator would run on host memory (forced, or P2P failed in auto mode),
    the doctor reports the cache file it reads: transport cuda_host, table key hostmem."""
    fixture = fixture_with_transport(name, tmp_path, transport)
    lines = (fixture / "query_gpu.csv").read_text().splitlines()
    names = [line.split(", ")[1] for line in lines]
    driver = f"driver {lines[0].split(', ')[-1]}, cuda {torch.version.cuda}"
    topo = _C.Topology.from_nvidia_smi((fixture / "nvidia_smi_topo.txt").read_text())
    island_of = list(topo.island_of()) if len(topo.islands()) > 1 else []
    fields = policy.fingerprint_fields(
        "cuda_host",
        topo.world,
        "hostmem",
        island_of,
        names,
        driver,
        topo.subset(list(range(topo.world))).fingerprint(),
    )
    fp = policy.fingerprint(fields)
    _, before = run_json(capsys, "--fixture", str(fixture))
    assert before["table"]["gpu_cache"] == {
        "fingerprint": fp,
        "path": str(fixture / "cache" / f"{fp}.csv"),
        "status": "missing",
    }

    write_valid_cache(fixture / "cache" / f"{fp}.csv", fp, fields)
    _, after = run_json(capsys, "--fixture", str(fixture))
    assert after["table"]["gpu_cache"]["status"] == "valid"
    assert f"{fp}.csv" in after["table"]["in_use"]


def test_gpu_cache_for_this_host_is_found_by_its_fingerprint(capsys, tmp_path):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    lines = (fixture / "query_gpu.csv").read_text().splitlines()
    names = [line.split(", ")[1] for line in lines]
    driver = f"driver {lines[0].split(', ')[-1]}, cuda {torch.version.cuda}"
    # The communicator's links field: its group's subset of the host topology.
    topo = _C.Topology.from_nvidia_smi((fixture / "nvidia_smi_topo.txt").read_text())
    links = topo.subset(list(range(8))).fingerprint()
    fields = policy.fingerprint_fields(
        "cuda", 8, "islands-2x4", [0] * 4 + [1] * 4, names, driver, links
    )
    fp = policy.fingerprint(fields)
    _, before = run_json(capsys, "--fixture", str(fixture))
    assert before["table"]["gpu_cache"] == {
        "fingerprint": fp,
        "path": str(fixture / "cache" / f"{fp}.csv"),
        "status": "missing",
    }
    assert before["table"]["in_use"].startswith("embedded seed table")

    write_valid_cache(fixture / "cache" / f"{fp}.csv", fp, fields)
    _, after = run_json(capsys, "--fixture", str(fixture))
    assert after["table"]["gpu_cache"]["status"] == "valid"
    assert f"{fp}.csv" in after["table"]["in_use"]


def test_table_from_the_environment_is_parsed(capsys, tmp_path):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "good.csv").write_text("*,*,*,0,*,fallback,,,,\n")
    (fixture / "bad.csv").write_text("islands-2x4,8,bf16,0,100,oneshot,sideways,0,8,256\n")
    (fixture / "env").write_text("PCIE_ALLREDUCE_TABLE=good.csv\n")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["table"]["env_table"]["ok"] is True
    assert report["table"]["in_use"] == f"PCIE_ALLREDUCE_TABLE {fixture / 'good.csv'}"

    (fixture / "env").write_text("PCIE_ALLREDUCE_TABLE=bad.csv\n")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 1 and report["table"]["env_table"]["ok"] is False
    assert "table" in [d["reason"] for d in report["declines"]]
    assert "bad.csv" in report["verdict"] and "sideways" in report["verdict"]


# ---------------------------------------------------------------------------- P2P test


class RunnableFixture(system.FixtureSystem):
    """A recorded host on which the doctor may 'run' its P2P test (with a fake runner)."""

    def can_run_tests(self) -> bool:
        return True


def no_p2p_reason(pairs: list[tuple[int, int]]) -> str:
    """The disabled_reason a communicator reports after a failed write-and-verify."""
    shown = ", ".join(f"rank {s} -> rank {d}" for s, d in pairs[:8])
    return (
        f"no_p2p: peer writes or reads did not arrive intact ({shown}); check the IOMMU/ACS "
        "settings of the PCIe path between those GPUs"
    )


def fake_runner(
    result: dict[str, Any] | None,
    calls: list[int],
    returncode: int = 0,
    timed_out: bool = False,
    noise: str = "",
) -> p2p.P2PRunner:
    def runner(world: int, timeout_s: float) -> system.RunResult:
        calls.append(world)
        out = noise
        if result is not None:
            out += p2p.P2P_RESULT_TAG + json.dumps(result) + "\n"
        return system.RunResult(None if timed_out else returncode, out, timed_out)

    return runner


def p2p_host(tmp_path: Path) -> tuple[RunnableFixture, inventory.Inventory]:
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "p2p.json").unlink()
    system = RunnableFixture(fixture)
    inv = inventory.gather_inventory(system)
    assert inv is not None
    return system, inv


def test_p2p_failures_are_parsed_per_pair_and_cached(tmp_path):
    system, inv = p2p_host(tmp_path)
    broken = [(0, 4), (4, 0), (1, 5)]
    calls: list[int] = []
    runner = fake_runner(
        {"enabled": False, "reason": no_p2p_reason(broken)}, calls, noise="warming up\n"
    )
    first = p2p.check_p2p(system, inv, skip=False, runner=runner)
    assert calls == [8] and first["source"] == "test"
    assert first["status"] == "failed"
    assert sorted(map(tuple, first["failing"])) == sorted(broken)
    by_pair = {(p["src"], p["dst"]): p["status"] for p in first["pairs"]}
    assert len(by_pair) == 56 and by_pair[(0, 4)] == "failed" and by_pair[(4, 1)] == "ok"
    cache_file = Path(first["cache_file"])
    assert cache_file.parent == system.cache_dir() and cache_file.name.startswith("p2p-")

    again = p2p.check_p2p(system, inv, skip=True, runner=fake_runner(None, calls))
    assert calls == [8]  # not run again
    assert again["source"] == "cached" and again["failing"] == first["failing"]
    table = tables.table_report(system, inv)
    tactics = verdict.tactic_report(8, inv.island_of)
    p2p_only = verdict.transport_report(inv, again, "p2p")
    ok, text, declines = verdict.gpu_verdict(inv, again, table, tactics, p2p_only)
    assert ok is False and "GPU1 -> GPU5" in text and [d["reason"] for d in declines] == ["no_p2p"]
    ok, text, declines = verdict.gpu_verdict(inv, again, table, tactics)  # auto
    assert ok is True and "GPU1 -> GPU5" in text and "cuda_host" in text and declines == []


def test_p2p_cache_is_keyed_by_driver_bus_ids_and_names(tmp_path):
    system, inv = p2p_host(tmp_path)
    buses = [g["bus_id"] for g in inv.gpus]
    names = [g["name"] for g in inv.gpus]
    key = p2p.p2p_cache_key(inv.driver, buses, names)
    assert p2p.p2p_cache_key(inv.driver, list(reversed(buses)), names) == key  # sorted
    assert p2p.p2p_cache_key("999.1", buses, names) != key
    assert p2p.p2p_cache_key(inv.driver, buses, ["other"] * 8) != key
    assert p2p.p2p_cache_file(system.cache_dir(), inv).name == f"p2p-{key}.json"


def test_a_full_list_of_eight_failures_marks_other_pairs_unverified(tmp_path):
    system, inv = p2p_host(tmp_path)
    broken = [(s, d) for s in range(4) for d in range(4, 8)][:9]
    runner = fake_runner({"enabled": False, "reason": no_p2p_reason(broken)}, [])
    result = p2p.check_p2p(system, inv, skip=False, runner=runner)
    assert result["truncated"] is True and len(result["failing"]) == 8
    statuses = {p["status"] for p in result["pairs"]}
    assert statuses == {"failed", "unverified"}


def test_all_pairs_ok_is_cached_and_counted(tmp_path):
    system, inv = p2p_host(tmp_path)
    calls: list[int] = []
    result = p2p.check_p2p(
        system, inv, skip=False, runner=fake_runner({"enabled": True, "reason": None}, calls)
    )
    assert result["status"] == "ok" and len(result["pairs"]) == 56
    assert all(p["status"] == "ok" for p in result["pairs"])
    assert Path(result["cache_file"]).is_file()


@pytest.mark.parametrize("kind", ["crash", "timeout", "rank_error", "other_reason"])
def test_a_failed_p2p_test_is_reported_and_never_cached(tmp_path, kind):
    system, inv = p2p_host(tmp_path)
    calls: list[int] = []
    runner = {
        "crash": fake_runner(None, calls, returncode=-11, noise="Segmentation fault\n"),
        "timeout": fake_runner(None, calls, timed_out=True),
        "rank_error": fake_runner({"error": "rank 3: RuntimeError: CUDA error"}, calls, 1),
        "other_reason": fake_runner({"enabled": False, "reason": "multi_host: ..."}, calls),
    }[kind]
    result = p2p.check_p2p(system, inv, skip=False, runner=runner, timeout_s=7)
    expect = {
        "crash": "Segmentation fault",
        "timeout": "within 7 s",
        "rank_error": "CUDA error",
        "other_reason": "multi_host",
    }[kind]
    assert expect in result["detail"]
    assert result["status"] == ("inconclusive" if kind == "other_reason" else "error")
    assert not Path(result["cache_file"]).exists()
    declines = verdict.gpu_declines(inv, result)
    assert [d["reason"] for d in declines] == ([] if kind == "other_reason" else ["no_p2p"])
    assert verdict.gpu_declines(inv, result, "hostmem") == []  # P2P is never tried there


@pytest.mark.parametrize(
    "transport, ok, name, declines",
    [
        ("auto", True, "cuda_host", []),
        ("p2p", False, "cuda_ipc", ["no_p2p"]),
        ("hostmem", True, "cuda_host", []),
    ],
)
def test_a_tested_p2p_failure_leads_where_the_transport_setting_says(
    tmp_path, transport, ok, name, declines
):
    fixture = fixture_with_transport("two_socket_8gpu", tmp_path, transport)
    (fixture / "p2p.json").unlink()
    calls: list[int] = []
    runner = fake_runner({"enabled": False, "reason": no_p2p_reason([(0, 4), (4, 0)])}, calls)
    report = doctor.run(RunnableFixture(fixture), p2p_runner=runner)
    assert calls == [8] and report["p2p"]["status"] == "failed"
    assert report["ok"] is ok and report["transport"]["name"] == name
    assert [d["reason"] for d in report["declines"]] == declines
    assert "GPU0 -> GPU4" in report["verdict"] and "GPU4 -> GPU0" in report["verdict"]
    assert report["table"]["gpu_cache"]["fingerprint"].startswith(f"{name}-w8-")


class _FakeQueue(list):
    def put(self, item: Any) -> None:
        self.append(item)


def test_the_p2p_subprocess_tests_peer_to_peer_whatever_the_environment(monkeypatch):
    """Each rank constructs its communicator with transport="p2p": in auto mode a failed
    check would move to host memory and stay enabled, hiding the failure."""
    import torch.distributed as dist

    import pcie_allreduce.communicator as communicator

    made: list[dict[str, Any]] = []

    class FakeAllReduce:
        """Behaves like the communicator on a host whose peer writes do not arrive."""

        def __init__(self, group: Any, device: Any, **kwargs: Any) -> None:
            made.append(kwargs)
            mode = kwargs.get("transport") or os.environ.get("PCIE_ALLREDUCE_TRANSPORT", "auto")
            self.enabled = mode != "cuda_ipc"  # auto and hostmem run over host memory
            self.disabled_reason = None if self.enabled else no_p2p_reason([(0, 1), (1, 0)])

        def destroy(self) -> None:
            pass

    monkeypatch.setattr(communicator, "PcieAllReduce", FakeAllReduce)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)
    for env in (None, "auto", "hostmem"):
        if env is None:
            monkeypatch.delenv("PCIE_ALLREDUCE_TRANSPORT", raising=False)
        else:
            monkeypatch.setenv("PCIE_ALLREDUCE_TRANSPORT", env)
        queue = _FakeQueue()
        p2p._p2p_rank(0, 2, "/nonexistent/rendezvous", 5.0, queue)
        assert made[-1]["transport"] == "cuda_ipc"
        assert queue == [{"enabled": False, "reason": no_p2p_reason([(0, 1), (1, 0)])}]
        out = p2p.P2P_RESULT_TAG + json.dumps(queue[0]) + "\n"
        result = p2p.interpret_p2p_run(2, system.RunResult(0, out), 5.0)
        assert result["status"] == "failed" and result["failing"] == [[0, 1], [1, 0]]


def test_p2p_subprocess_sees_every_gpu_in_bus_order_with_the_backend_on():
    env = system.probe_env(
        {
            "CUDA_VISIBLE_DEVICES": "1",
            "PCIE_ALLREDUCE_ENABLE": "0",
            "PCIE_ALLREDUCE_TABLE": "x.csv",
            "PATH": "/bin",
            "PCIE_ALLREDUCE_TRANSPORT": "bogus",
        }
    )
    assert env == {"PATH": "/bin", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    argv = p2p.p2p_probe_command(4, 30.0)
    assert argv[0] == sys.executable and argv[-2:] == ["4", "30.0"]
    compile(argv[2], "<p2p probe>", "exec")


def test_the_p2p_subprocess_command_imports_a_function_that_exists():
    import importlib
    import re

    code = p2p.p2p_probe_command(2, 1.0)[2]
    module, name = re.search(r"from (\S+) import (\w+);", code).groups()
    assert callable(getattr(importlib.import_module(module), name))


def _dead(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_hung_subprocess_is_killed_with_everything_it_started():
    start = time.monotonic()
    result = system.run_bounded(["sh", "-c", "sleep 60 & echo $!; wait"], 1.0, os.environ)
    assert result.timed_out and result.returncode is None
    assert time.monotonic() - start < 10
    grandchild = int(result.output.split()[0])
    deadline = time.monotonic() + 5
    while not _dead(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(grandchild)


# ---------------------------------------------------------------------------- NVML


def fake_nvml(levels: list[list[int]], nvlinks: dict[int, list[str]]) -> types.SimpleNamespace:
    """A pynvml stand-in: ``levels`` the common-ancestor matrix, ``nvlinks`` GPU -> the bus
    ids its active links reach."""
    n = len(levels)
    buses = [f"00000000:{0x18 + 0x20 * i:02X}:00.0" for i in range(n)]

    class NVMLError(Exception):
        pass

    def link_state(h: int, link: int) -> int:
        if h not in nvlinks:
            raise NVMLError("Not Supported")
        return 1 if link < len(nvlinks[h]) else 0

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_MAX_LINKS=4,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",
        nvmlDeviceGetCount=lambda: n,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA RTX PRO 6000 Blackwell",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=buses[h].encode()),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: levels[a][b],
        nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, link: types.SimpleNamespace(
            busId=nvlinks[h][link]
        ),
    )


def test_nvml_inventory_builds_the_same_topology_nvidia_smi_would():
    node, sys_, phb = 40, 50, 30
    levels = [
        [0 if a == b else (phb if a // 2 == b // 2 else sys_) for b in range(4)] for a in range(4)
    ]
    levels[0][1] = levels[1][0] = node
    raw = inventory.nvml_inventory(fake_nvml(levels, {}))
    assert raw.driver == "570.86.15" and raw.bus_ids[1] == "0000:38:00.0"
    topo = _C.Topology.from_nvidia_smi(raw.topo_text)
    assert topo.islands() == [[0, 1], [2, 3]] and topo.table_key() == "islands-2x2"
    assert topo.link(0, 1) == "NODE" and topo.link(2, 3) == "PHB" and not topo.has_nvlink()


def test_nvml_nvlink_pairs_and_nvswitch_links_become_nv_classes():
    levels = [[0 if a == b else 50 for b in range(4)] for a in range(4)]
    bus = lambda i: f"00000000:{0x18 + 0x20 * i:02X}:00.0"  # noqa: E731
    direct = inventory.nvml_inventory(fake_nvml(levels, {0: [bus(1)] * 2, 1: [bus(0)] * 2}))
    topo = _C.Topology.from_nvidia_smi(direct.topo_text)
    assert topo.nvlink_pairs() == [(0, 1)] and topo.link(2, 3) == "SYS"
    switch = "00000000:C5:00.0"  # an NVSwitch, not a GPU
    via_switch = inventory.nvml_inventory(fake_nvml(levels, {i: [switch] * 3 for i in range(4)}))
    topo = _C.Topology.from_nvidia_smi(via_switch.topo_text)
    assert len(topo.nvlink_pairs()) == 6 and topo.table_key() == "nvlink"


# ---------------------------------------------------------------------------- IOMMU, helpers


@pytest.mark.parametrize(
    "cmdline, groups, mode",
    [
        ("ro quiet intel_iommu=on", None, "translated"),
        ("ro intel_iommu=on iommu=pt", ["DMA"], "passthrough"),
        ("ro amd_iommu=on iommu.passthrough=1", None, "passthrough"),
        ("ro intel_iommu=off", ["DMA"], "off"),
        ("ro quiet", [], "off"),
        ("ro quiet", ["identity", "identity"], "passthrough"),
        ("ro quiet", ["DMA-FQ", "identity"], "translated"),
        ("ro quiet", ["", ""], "on"),
        (None, None, "unknown"),
    ],
)
def test_iommu_mode_from_cmdline_and_group_types(cmdline, groups, mode):
    assert iommu.iommu_mode(cmdline, groups)[0] == mode


def test_iommu_hint_is_a_hint_not_a_failure(capsys, tmp_path):
    fixture = copy_fixture("two_socket_8gpu", tmp_path)
    (fixture / "cmdline").write_text("BOOT_IMAGE=/vmlinuz ro intel_iommu=on\n")
    code, report = run_json(capsys, "--fixture", str(fixture))
    assert code == 0 and report["iommu"]["mode"] == "translated"
    assert len(report["iommu"]["hints"]) == 1  # no ACS hint: every pair works


@pytest.mark.parametrize(
    "given, sysfs",
    [
        ("00000000:41:00.0", "0000:41:00.0"),
        ("00000001:A1:00.1", "0001:a1:00.1"),
        ("41:00.0", "0000:41:00.0"),
        ("0000:41:00.0", "0000:41:00.0"),
    ],
)
def test_bus_ids_are_spelled_as_sysfs_spells_them(given, sysfs):
    assert system.sysfs_bus_id(given) == sysfs


def test_host_bench_result_must_show_the_kernels_ran():
    ok = json.dumps({"rows": [{"tactic": "oneshot/push"}], "stats": {"enabled": True}})
    off = json.dumps(
        {
            "rows": [{"tactic": "fallback"}],
            "stats": {"enabled": False, "disabled_reason": "disabled: shm"},
        }
    )
    assert host_transport.interpret_host_run(system.RunResult(0, ""), ok, 60)["status"] == "ok"
    result = host_transport.interpret_host_run(system.RunResult(0, ""), off, 60)
    assert result["status"] == "failed" and "disabled: shm" in result["detail"]
    crashed = host_transport.interpret_host_run(
        system.RunResult(1, "a\nb\nranks [1] failed\n"), None, 60
    )
    assert crashed["status"] == "failed" and "ranks [1] failed" in crashed["detail"]
    assert (
        "within 60 s"
        in host_transport.interpret_host_run(system.RunResult(None, "", timed_out=True), None, 60)[
            "detail"
        ]
    )


def test_host_bench_result_shows_the_self_test():
    def run(self_test):
        stats = {"enabled": True, "self_test": self_test}
        bench = json.dumps({"rows": [{"tactic": "oneshot/push"}], "stats": stats})
        return host_transport.interpret_host_run(system.RunResult(0, ""), bench, 60)

    passed = run({"cases": 50, "failed": [], "seconds": 0.1})
    assert passed["status"] == "ok" and "self-test: 50 " in passed["detail"], passed
    wrong = {"op": "all_reduce", "dtype": "bf16", "tactic": "oneshot/push/unstaged/flag"}
    failed = run({"cases": 50, "failed": [dict(wrong, detail="rank 1: out element 3")]})
    assert failed["status"] == "failed", failed
    assert (
        "withdrew 1 tactic" in failed["detail"] and "oneshot/push/unstaged/flag" in failed["detail"]
    )
    assert "rank 1: out element 3" in failed["detail"]


# ---------------------------------------------------------------------------- this machine


def _this_machine_has_gpus() -> bool:
    return torch.cuda.device_count() > 0 or shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(_this_machine_has_gpus(), reason="the live no-GPU path needs a GPU-less box")
def test_live_doctor_without_gpus_runs_the_host_transport(capsys):
    code, report = run_json(capsys)
    assert code == 0 and report["ok"] is True
    assert report["gpus"]["count"] == 0
    assert report["host_transport"]["status"] == "ok"
    assert report["host_transport"]["source"] == "test"
    assert "no GPU found" in report["verdict"]
