"""The cost model's refit (pcie_allreduce.tuning.refit) on microbenchmark JSONL: what it fits
from which record, what it keeps and says where from, the seed rows and predictions it
re-derives with the real cost model (no mocks), and the lines it refuses or skips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcie_allreduce.native import _C
from pcie_allreduce.tuning import model, refit

DATA = Path(__file__).parent / "data"
SYNTHETIC = DATA / "microbench_synthetic.jsonl"
H200 = DATA / "h200_loopback.jsonl"
DEVICE = "NVIDIA H100 80GB HBM3 sm_90"
DATE = "2026-12-01"
# What microbench_synthetic.jsonl measures: the PDL graph launch 1.1 µs (plain 2.4), one serial
# poll of L2 500 ns and of host memory 900/1000/1200 ns (three runs appended), a fence at 16 CTAs
# 600 ns after device writes and 1000 ns after host-memory writes (other CTA counts differ).
FITTED = {
    "launch_us": 1.1,
    "local_load_us": 0.5,
    "host_read_us": 1.0,
    "fence_after_local_writes_us": 0.6,
    "fence_after_peer_writes_us": 1.0,
}
MB = '{"program": "microbench", "device": "GPU sm_90", '


@pytest.fixture(scope="module")
def synthetic() -> refit.Refit:
    return refit.refit(SYNTHETIC, date=DATE)


@pytest.fixture(scope="module")
def synthetic_report(synthetic: refit.Refit) -> dict:
    return refit.report(synthetic)


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "results.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_provenance_table_names_every_constant_of_the_model():
    names = set(_C.latency_model())
    assert set(refit.PROVENANCE) == names
    assert {source for source, _ in refit.PROVENANCE.values()} == {"published", "guess"}
    assert all(text for _, text in refit.PROVENANCE.values())
    # Each constant is either fitted from a bench or says why one GPU cannot measure it.
    fitted = {f.constant for f in refit.fits()}
    assert fitted == set(FITTED)
    assert fitted | set(refit.UNMEASURED) == names
    assert not fitted & set(refit.UNMEASURED)


def test_the_synthetic_run_fits_five_constants_from_their_benches(synthetic: refit.Refit):
    defaults = _C.latency_model()
    assert synthetic.fitted == pytest.approx(FITTED)
    for name, value in synthetic.constants.items():
        assert value == pytest.approx(FITTED.get(name, defaults[name]))
    p = synthetic.provenance
    assert p["host_read_us"] == {
        "value": 1.0,
        "source": "measured",
        "device": DEVICE,
        "date": DATE,
        "bench": "flag_polls memory=host(PCIe) flags=1 (median of 3)",
    }
    assert p["launch_us"]["bench"] == "graph_launch pdl=true (median of 1)"
    fences = p["fence_after_local_writes_us"], p["fence_after_peer_writes_us"]
    assert fences[0]["bench"] == "system_fence memory=device ctas=16 (median of 1)"
    assert fences[1]["bench"] == "system_fence memory=host(PCIe) ctas=16 (median of 1)"
    defaults_p = refit.default_provenance()
    for name in set(defaults) - set(FITTED):
        assert p[name] == defaults_p[name]
        assert p[name]["source"] in ("published", "guess")
    assert synthetic.records.skipped == {"(no program: quick.sh steps)": 2}
    assert synthetic.unknown_benches == {}
    assert synthetic.warnings == []


def test_the_benches_without_a_constant_are_reported_as_such(synthetic_report: dict):
    records = synthetic_report["records"]
    assert set(records["no_constant"]) == {"copy_allreduce", "copy_round_trip", "idle_sync"}
    assert records["used"] == {
        "copy_allreduce": 1,
        "copy_round_trip": 1,
        "flag_polls": 8,
        "graph_launch": 2,
        "idle_sync": 1,
        "system_fence": 6,
    }


def _change(rep: dict, topology: str, world: str, collective: str, lo: int) -> dict:
    return next(
        c
        for c in rep["seed"]["changes"]
        if (c["topology"], c["world"], c["collective"]) == (topology, world, collective)
        and c["min_bytes"] <= lo < (c["max_bytes"] or 1 << 62)
    )


def test_a_cheaper_host_fence_moves_cuda_host_world_2_to_the_flag_protocol_sooner(
    synthetic: refit.Refit, synthetic_report: dict
):
    # The flag tactic pays one fence after its writes to host memory; lamport pays none. The
    # fence fell from 2.5 to 1.0 µs, so at 96 KiB (bucket [64, 128) KiB) flag now wins.
    c = _change(synthetic_report, "cuda_host", "2", "all_reduce", 65536)
    assert (c["min_bytes"], c["max_bytes"]) == (65536, 131072)
    assert c["before"] == "oneshot,push,0,8,256,lamport"
    assert c["after"] == "oneshot,push,0,16,256"

    def gap(constants: dict | None) -> float:  # flag minus lamport, at the bucket's size
        ranked = model.rank_tactics(2, [0, 0], "cuda_host", 92672, constants)
        us = {(t["algorithm"], t["staged"], t["protocol"]): t["modelled_us"] for t in ranked}
        return us[("oneshot", False, "flag")] - us[("oneshot", False, "lamport")]

    assert gap(None) > 0 > gap(synthetic.fitted)
    # The rows to paste are the model's own derivation with the fitted constants.
    assert synthetic_report["seed"]["rows"] == model.derive_seed_rows(synthetic.fitted)
    assert "+cuda_host,2,*,65536,131072,oneshot,push,0,16,256" in synthetic_report["seed"]["diff"]


def test_dearer_local_loads_move_world_8_to_the_flat_oneshot_sooner(synthetic_report: dict):
    # island_oneshot's critical path has more local links than the flat one-shot's (five local
    # loads against three: the island's look, the partial's re-read): each local load going from
    # 0.3 to 0.5 µs costs it more, and the flat form's extra bytes matter less.
    c = _change(synthetic_report, "islands-2x4", "8", "all_reduce", 8192)
    assert (c["min_bytes"], c["max_bytes"]) == (8192, 16384)
    assert c["before"] == "island_oneshot,push,0,8,256,lamport"
    assert c["after"] == "oneshot,push,0,8,256,lamport"
    unchanged = [
        c for c in synthetic_report["seed"]["changes"] if c["topology"] == "*" and c["world"] == "2"
    ]
    assert [c["collective"] for c in unchanged] == ["all_gather"]  # world 2's all-reduce stays


def test_the_predictions_move_as_the_fitted_constants_say(synthetic_report: dict):
    pred = synthetic_report["predictions"]
    assert pred["bytes"] == 12288
    before = {p["target"]: p for p in pred["before"]}
    after = {p["target"]: p for p in pred["after"]}
    assert list(before) == [name for name, _, _ in refit.TARGETS]
    wire = 12288 / 44.8e3  # 12 KiB out of one GPU at gpu_link_gbps
    # TP2 over P2P, oneshot lamport: launch, the counter and the input (local loads), then the
    # later of the peer's posted write landing and the reader's own first look (one more local
    # load), then the poll that sees it. Defaults: the write (0.45) is the later; fitted: the
    # look (0.5).
    tp2 = before["world 2, P2P"], after["world 2, P2P"]
    assert tp2[0]["us"] == pytest.approx(0.6 + 2 * 0.3 + 0.45 + 0.3 + wire, abs=1e-3)
    assert tp2[1]["us"] == pytest.approx(1.1 + 2 * 0.5 + 0.5 + 0.5 + wire, abs=1e-3)
    assert tp2[0]["tactic"] == tp2[1]["tactic"] == "oneshot/push/unstaged/lamport"
    # TP8 (4+4): every link is as dear or dearer, so the old critical path alone (launch and
    # five local loads) grows by 0.5 + 5 x 0.2 µs; the model may find a longer one.
    tp8 = before["world 8 (4+4), P2P"], after["world 8 (4+4), P2P"]
    # Before: island_oneshot lamport, launch, counter, input, posted write 0.45, the island's one
    # look (every operand in it: the decode-shaped kernels), the partial re-read, the write
    # across 0.44, the look that sees it (2.99), then a rank's 48 KiB out to four peers in one
    # stage (the socket link is priced per rank's flow).
    assert tp8[0]["us"] == pytest.approx(2.99 + 4 * 12288 / 25.4e3, abs=1e-3)
    assert tp8[0]["tactic"] == "island_oneshot/push/unstaged/lamport"
    assert tp8[1]["us"] >= tp8[0]["us"] + 0.5 + 5 * 0.2 - 1e-9
    # cuda_host, world 2: host reads 1.5 -> 1.0 µs outweigh the dearer launch and local loads.
    host2 = before["world 2, cuda_host"], after["world 2, cuda_host"]
    assert host2[1]["us"] == pytest.approx(1.1 + 2 * 0.5 + 2 * 1.0 + 2 * wire, abs=1e-3)
    assert host2[1]["us"] < host2[0]["us"]
    # cuda_host, world 4: lamport stays the best at 12 KiB (its one look at every operand is
    # relooked together); the cheaper fence moves the flag protocol in from 16 KiB.
    host4 = before["world 4, cuda_host"], after["world 4, cuda_host"]
    assert host4[0]["tactic"] == host4[1]["tactic"] == "oneshot/push/unstaged/lamport"
    assert host4[1]["us"] < host4[0]["us"]
    c = _change(synthetic_report, "cuda_host", "4", "all_reduce", 16384)
    assert (c["min_bytes"], c["after"]) == (16384, "oneshot,push,0,16,256")


def test_launch_takes_the_plain_record_when_asked_or_when_there_is_no_pdl_one(tmp_path: Path):
    plain = refit.refit(SYNTHETIC, date=DATE, launch="plain")
    assert plain.constants["launch_us"] == pytest.approx(2.4)
    assert plain.provenance["launch_us"]["bench"] == "graph_launch pdl=false (median of 1)"
    old_gpu = _write(tmp_path, MB + '"bench": "graph_launch", "pdl": false, "us": 3.000}')
    assert refit.refit(old_gpu, date=DATE).fitted == {"launch_us": 3.0}


def test_the_fence_uses_the_cta_count_nearest_the_flag_rows(tmp_path: Path):
    path = _write(
        tmp_path,
        MB + '"bench": "system_fence", "memory": "device", "ctas": 1, "no_fence_ns": 0, '
        '"fence_ns": 100}',
        MB + '"bench": "system_fence", "memory": "device", "ctas": 32, "no_fence_ns": 0, '
        '"fence_ns": 900}',
    )
    assert refit.refit(path, date=DATE).fitted == {"fence_after_local_writes_us": 0.9}


def test_a_fence_that_costs_nothing_keeps_the_default_and_says_so(tmp_path: Path):
    path = _write(
        tmp_path,
        MB + '"bench": "system_fence", "memory": "device", "ctas": 16, "no_fence_ns": 50, '
        '"fence_ns": 40}',
    )
    r = refit.refit(path, date=DATE)
    assert r.fitted == {}
    assert r.provenance == refit.default_provenance()
    assert len(r.warnings) == 1 and r.warnings[0].startswith("fence_after_local_writes_us")


def test_the_h200_loopback_numbers_refit_nothing():
    # The only GPU numbers on record (docs/benchmarks.md, "loopback on one H200") are whole
    # all-reduce calls of N virtual ranks on one GPU, printed by pcie_gpu_check, not
    # microbenchmarks of a constant: no LatencyModel field can be read off them (each mixes the
    # launch, L2 polls and CTA scheduling, and none crosses PCIe). Written as the records that
    # program would give, they are skipped, and the refit leaves everything as it is.
    r = refit.refit(H200, date=DATE)
    assert r.records.skipped == {"pcie_gpu_check": 200}
    assert r.records.by_bench == {}
    assert r.fitted == {}
    assert r.constants == pytest.approx(_C.latency_model())
    assert r.provenance == refit.default_provenance()
    rep = refit.report(r)
    assert rep["seed"]["changes"] == [] and rep["seed"]["diff"] == []
    assert rep["seed"]["rows"] == model.derive_seed_rows()
    assert rep["predictions"]["before"] == rep["predictions"]["after"]


def test_unknown_benches_are_reported_and_fit_nothing(tmp_path: Path):
    # The same loopback numbers as if microbench had written them: a bench it does not know.
    lines = H200.read_text().replace('"pcie_gpu_check"', '"microbench"').splitlines()
    r = refit.refit(_write(tmp_path, *lines), date=DATE)
    assert r.unknown_benches == {"loopback_latency": 200}
    assert r.fitted == {} and r.provenance == refit.default_provenance()
    text = refit.render(refit.report(r))
    assert "unknown bench 'loopback_latency': 200 records, no constant" in text


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ('{"program": "microbench", "device": ', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (MB + '"bench": "system_fence", "ctas": 16, "no_fence_ns": 1, "fence_ns": 2}', "'memory'"),
        (MB + '"bench": "graph_launch", "pdl": true, "us": "1.1"}', "'us' is not a float"),
        (
            MB + '"bench": "flag_polls", "memory": "device", "flags": true, "serial_ns": 1, '
            '"parallel_ns": 1}',
            "'flags' is not a int",
        ),  # fmt: skip
        ('{"program": "microbench", "bench": "idle_sync"}', "'device' is not a str"),
    ],
)
def test_a_malformed_line_is_an_error_naming_its_line(tmp_path: Path, bad: str, why: str, capsys):
    good = MB + '"bench": "graph_launch", "pdl": true, "us": 1.0}'
    path = _write(tmp_path, '{"part": "kernels", "step": "build", "status": "ok"}', "", good, bad)
    with pytest.raises(refit.RefitError, match=rf"results\.jsonl:4: .*{why}"):
        refit.refit(path, date=DATE)
    assert refit.main([str(path)]) == 2
    assert ":4: " in capsys.readouterr().err


def test_records_of_several_devices_need_a_choice(tmp_path: Path):
    other = '{"program": "microbench", "device": "Other sm_120", '
    path = _write(
        tmp_path,
        MB + '"bench": "graph_launch", "pdl": true, "us": 1.0}',
        other + '"bench": "graph_launch", "pdl": true, "us": 2.0}',
    )
    with pytest.raises(refit.RefitError, match="several devices"):
        refit.refit(path, date=DATE)
    r = refit.refit(path, device="Other sm_120", date=DATE)
    assert r.fitted == {"launch_us": 2.0}
    assert r.provenance["launch_us"]["device"] == "Other sm_120"
    assert r.records.skipped == {"microbench on GPU sm_90": 1}
    with pytest.raises(refit.RefitError, match="no microbench record of device 'Nope'"):
        refit.refit(path, device="Nope", date=DATE)


def test_the_command_prints_the_comparison_and_writes_json(tmp_path: Path, capsys):
    out = tmp_path / "refit.json"
    assert refit.main([str(SYNTHETIC), "--date", DATE, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"| `host_read_us` | 1 | measured: {DEVICE}, {DATE}, flag_polls" in text
    assert "| world 2, P2P | `oneshot/push/unstaged/lamport` | 2.22 (4) |" in text
    assert "  cuda_host,2 all_reduce [65536, 131072): oneshot,push,0,8,256,lamport -> " in text
    assert "benchmarks/tables.py" in text  # says why docs/benchmarks.md is not rewritten
    rep = json.loads(out.read_text())
    assert rep["constants"]["launch_us"]["value"] == 1.1
    assert rep["predictions"]["after"][0]["us"] == pytest.approx(3.3743, abs=1e-3)


def test_the_date_defaults_to_the_files_modification_date(tmp_path: Path):
    import os

    path = _write(tmp_path, MB + '"bench": "graph_launch", "pdl": true, "us": 1.0}')
    os.utime(path, (1_800_000_000, 1_800_000_000))  # 2027-01-15 08:00 UTC
    assert refit.refit(path).provenance["launch_us"]["date"] == "2027-01-15"
