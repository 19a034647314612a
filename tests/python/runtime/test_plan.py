"""The plan layer through Python: pcie_allreduce.plan.build(...).verify() / to_dict()."""

import pytest

from pcie_allreduce import plan
from pcie_allreduce.native import _C
from pcie_allreduce.tuning import model

TWO_BY_FOUR = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_island_twoshot_crosses_the_socket_link_once_each_way():
    v = plan.build("island_twoshot", 8, islands=TWO_BY_FOUR).verify()
    assert v["ok"], v["errors"]
    assert v["cross_island_elements"] == 1.0
    assert v["cross_island_by_direction"] == [1.0, 1.0]
    assert v["max_outbound_per_stage"] == 1 and v["max_inbound_per_stage"] == 1


def test_flat_oneshot_crosses_sixteen_times():
    v = plan.build("oneshot", 8, islands=TWO_BY_FOUR).verify()
    assert v["ok"]
    assert v["cross_island_elements"] == 16.0


def test_unstaged_schedule_reports_its_fan_out():
    v = plan.build("oneshot", 4, staged=False, direction="pull").verify()
    assert v["ok"]
    assert v["max_inbound_per_stage"] == 3


@pytest.mark.parametrize("algorithm", plan.ALGORITHMS)
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_every_algorithm_verifies_in_place_too(algorithm, direction):
    s = plan.build(algorithm, 6, islands=[[0, 2, 4], [1, 3, 5]], direction=direction)
    assert s.verify()["ok"]
    assert s.verify(in_place=True)["ok"]


def test_to_dict_lists_every_ranks_steps():
    d = plan.build("twoshot", 4, direction="pull", staged=True).to_dict()
    assert d["algorithm"] == "twoshot" and d["direction"] == "pull" and d["staged"] is True
    assert len(d["programs"]) == 4
    kinds = {step["kind"] for program in d["programs"] for step in program}
    assert kinds == {"reduce", "signal", "wait"}
    first_reduce = next(s for s in d["programs"][0] if s["kind"] == "reduce")
    assert {"chunk", "dst", "srcs", "stage", "text"} <= set(first_reduce)


def test_refuses_with_a_reason():
    with pytest.raises(ValueError, match="uneven"):
        plan.build("island_oneshot", 8, islands=[[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="no islands"):
        plan.build("island_twoshot", 8)
    with pytest.raises(ValueError, match="algorithm must be"):
        plan.build("threeshot", 4)
    with pytest.raises(ValueError, match="in no island"):
        plan.build("oneshot", 4, islands=[[0, 1], [2]])
    assert plan.why_unsupported("island_twoshot", 4, [[0, 1], [2, 3]]) is None


@pytest.mark.parametrize("algorithm", plan.ALGORITHMS)
def test_ll_schedules_pay_no_fence_and_poll_only_their_own_memory(algorithm):
    s = plan.build(algorithm, 8, islands=TWO_BY_FOUR, staged=False, protocol="ll")
    assert s.protocol == "ll"
    assert s.verify()["ok"]
    assert s.verify(in_place=True)["ok"]
    cost = s.cost()
    assert cost["system_fences"] == 0 and cost["peer_polls"] == 0 and cost["local_waits"] == 0
    assert cost["data_polls"] > 0
    ll_refs = [
        ref
        for program in s.to_dict()["programs"]
        for step in program
        if step["kind"] == "reduce"
        for ref in [step["dst"], *step["srcs"]]
        if ref["space"] == "ll"
    ]
    assert ll_refs and all("writer" in ref for ref in ll_refs)
    assert {step["kind"] for p in s.to_dict()["programs"] for step in p} == {"reduce"}


@pytest.mark.parametrize("direction", ["push", "pull"])
@pytest.mark.parametrize("staged", [True, False])
def test_no_flag_schedule_polls_a_peer(direction, staged):
    for algorithm in plan.ALGORITHMS:
        cost = plan.build(
            algorithm, 8, islands=TWO_BY_FOUR, direction=direction, staged=staged
        ).cost()
        assert cost["peer_polls"] == 0, (algorithm, cost)
        assert cost["system_fences"] >= 1


def test_cost_counts_serial_fences_waits_and_hops():
    staged = plan.build("oneshot", 8, staged=True).cost()
    assert (staged["system_fences"], staged["local_waits"], staged["fabric_hops"]) == (7, 7, 7)
    unstaged = plan.build("oneshot", 8, staged=False).cost()
    assert (unstaged["system_fences"], unstaged["local_waits"], unstaged["fabric_hops"]) == (
        1,
        1,
        1,
    )
    island = plan.build("island_oneshot", 8, islands=TWO_BY_FOUR, staged=False, protocol="ll")
    assert island.cost()["fabric_hops"] == 2 and island.cost()["cross_island"] == 4.0


def test_ll_refuses_pull_and_staging_with_a_reason():
    with pytest.raises(ValueError, match="push-only"):
        plan.build("oneshot", 4, direction="pull", staged=False, protocol="ll")
    with pytest.raises(ValueError, match="unstaged"):
        plan.build("oneshot", 4, staged=True, protocol="ll")
    with pytest.raises(ValueError, match="protocol must be flag, ll or lamport"):
        plan.build("oneshot", 4, protocol="lowlat")
    assert "push-only" in plan.why_unsupported("oneshot", 4, direction="pull", protocol="ll")


# ------------------------------------------------------------------ the cost model


def test_cost_without_a_size_keeps_the_step_list_counts_only():
    c = plan.build("oneshot", 8, staged=False, protocol="ll").cost()
    assert c["system_fences"] == 0 and "modelled_us" not in c


def test_cost_with_a_size_models_one_call_on_each_gpu_transport():
    s = plan.build("oneshot", 2, staged=False, protocol="ll")
    p2p = s.cost(12288)
    host = s.cost(12288, transport="cuda_host")
    for c in (p2p, host):
        assert c["modelled_us"] == pytest.approx(c["latency_us"] + c["bandwidth_us"])
        assert c["critical_path"][0].startswith("launch ")
        assert len(c["critical_path"]) == c["serial_round_trips"] + 1
    assert p2p["busiest_link_bytes"] == 2 * 12288  # LL: payload and tags
    # Host memory: the reader's resets to the stale tag go back over its link too.
    assert host["busiest_link_bytes"] == 4 * 12288
    # On host memory every look is a PCIe read of host DRAM, not of this GPU's L2.
    assert host["latency_us"] > p2p["latency_us"]
    assert any("host memory read" in link for link in host["critical_path"])


def test_lamport_moves_the_payload_once_on_the_same_critical_path():
    for transport, ll_bytes in (("cuda_ipc", 2 * 12288), ("cuda_host", 4 * 12288)):
        ll = plan.build("oneshot", 2, staged=False, protocol="ll").cost(12288, transport=transport)
        dense = plan.build("oneshot", 2, staged=False, protocol="lamport").cost(
            12288, transport=transport
        )
        assert ll["busiest_link_bytes"] == ll_bytes
        assert dense["busiest_link_bytes"] == ll_bytes / 2
        assert dense["critical_path"] == ll["critical_path"]
        assert dense["modelled_us"] < ll["modelled_us"]


def test_cost_constants_and_executor_can_be_overridden_by_name():
    s = plan.build("oneshot", 4, staged=False, protocol="ll")
    base = s.cost(4096)
    later = s.cost(4096, constants={"launch_us": plan_launch() + 1.0})
    assert later["latency_us"] == pytest.approx(base["latency_us"] + 1.0)
    assert _C.executor_model()["parallel_relooks"] is True  # what today's executor does
    assert _C.executor_model()["first_look_group"] == 8
    grouped = s.cost(4096, executor={"parallel_relooks": False, "first_look_group": 2})
    assert base["serial_round_trips"] < grouped["serial_round_trips"]
    serial = s.cost(4096, executor={"parallel_first_look": False})
    assert serial["latency_us"] > base["latency_us"]
    with pytest.raises(ValueError, match="unknown cost-model constant 'lunch_us'.*launch_us"):
        s.cost(4096, constants={"lunch_us": 1.0})
    with pytest.raises(ValueError, match="unknown executor-model field"):
        s.cost(4096, executor={"pipelined": True})
    with pytest.raises(ValueError, match="GPU transports"):
        s.cost(4096, transport="host_shm")
    with pytest.raises(ValueError, match="transport must be"):
        s.cost(4096, transport="nvlink")


def plan_launch():
    return _C.latency_model()["launch_us"]


def test_the_seeds_gpu_rows_are_what_the_cost_model_derives():
    """The embedded seed's GPU estimates are the model's choices, row for row: a refit of the
    model's constants (or a change in what the executor does) must regenerate them
    (`python -m pcie_allreduce.tuning.model`)."""
    keys = {key for key, _, _, _ in model.gpu_families()}
    seed = [
        line
        for line in _C.TuningTable.embedded_text().splitlines()
        if line
        and not line.startswith("#")
        and line.split(",")[0] in keys
        and ",fallback" not in line
    ]
    assert seed == model.derive_seed_rows()


def test_derived_rows_cover_every_size_once():
    rows = model.derive_rows("*", "*", [0] * 8, "cuda_ipc")
    edges = [(int(r.split(",")[3]), r.split(",")[4]) for r in rows]
    assert edges[0][0] == 0 and edges[-1][1] == "*"
    for (_, hi), (lo, _) in zip(edges, edges[1:]):
        assert int(hi) == lo
    flag_in_data = [r for r in rows if r.split(",")[-1] in ("ll", "lamport")]
    assert flag_in_data and all(int(r.split(",")[4]) <= model.MAX_LL_BYTES for r in flag_in_data)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_collectives_are_two_shots_halves_and_cost_half_its_bytes(collective):
    whole = plan.build("twoshot", 4, staged=False).cost(1 << 20)
    half_schedule = plan.build("twoshot", 4, staged=False, collective=collective)
    assert half_schedule.verify()["ok"]
    assert half_schedule.to_dict()["collective"] == collective
    half = half_schedule.cost(1 << 20)
    assert half["busiest_link_bytes"] == whole["busiest_link_bytes"] / 2
    assert half["modelled_us"] < 0.6 * whole["modelled_us"]
    assert "two-shot algorithms" in plan.why_unsupported("oneshot", 4, collective=collective)
    with pytest.raises(ValueError):
        plan.build("island_oneshot", 4, islands=[[0, 1], [2, 3]], collective=collective)
    # The island form crosses the socket link once per chunk: a quarter of the flat one at 4+4.
    island = plan.build("island_twoshot", 8, islands=TWO_BY_FOUR, collective=collective).verify()
    flat = plan.build("twoshot", 8, islands=TWO_BY_FOUR, collective=collective).verify()
    assert island["ok"] and flat["ok"]
    assert island["cross_island_elements"] == 0.5 and flat["cross_island_elements"] == 2.0
