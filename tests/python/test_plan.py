"""The plan layer through Python: pcie_allreduce.plan.build(...).verify() / to_dict()."""

import pytest

from pcie_allreduce import plan

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
        cost = plan.build(algorithm, 8, islands=TWO_BY_FOUR, direction=direction,
                          staged=staged).cost()
        assert cost["peer_polls"] == 0, (algorithm, cost)
        assert cost["system_fences"] >= 1


def test_cost_counts_serial_fences_waits_and_hops():
    staged = plan.build("oneshot", 8, staged=True).cost()
    assert (staged["system_fences"], staged["local_waits"], staged["fabric_hops"]) == (7, 7, 7)
    unstaged = plan.build("oneshot", 8, staged=False).cost()
    assert (unstaged["system_fences"], unstaged["local_waits"],
            unstaged["fabric_hops"]) == (1, 1, 1)
    island = plan.build("island_oneshot", 8, islands=TWO_BY_FOUR, staged=False, protocol="ll")
    assert island.cost()["fabric_hops"] == 2 and island.cost()["cross_island"] == 4.0


def test_ll_refuses_pull_and_staging_with_a_reason():
    with pytest.raises(ValueError, match="push-only"):
        plan.build("oneshot", 4, direction="pull", staged=False, protocol="ll")
    with pytest.raises(ValueError, match="unstaged"):
        plan.build("oneshot", 4, staged=True, protocol="ll")
    with pytest.raises(ValueError, match="protocol must be flag or ll"):
        plan.build("oneshot", 4, protocol="lowlat")
    assert "push-only" in plan.why_unsupported("oneshot", 4, direction="pull", protocol="ll")
