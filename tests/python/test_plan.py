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
