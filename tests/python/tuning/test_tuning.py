"""The tuning cache and autotune on the host transport, with real processes: a tune writes a
cache whose every choice (all-reduce, reduce-scatter, all-gather, each against its own fallback)
is a correct tactic, the next communicator loads it and measures nothing, two tunes choose the
same, bad caches are reported and replaced, racing tunes neither corrupt the file nor both
measure, and every refusal is said on every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_ranks

MAX_NUMEL = 4096  # 8 KiB of bf16: buckets 1, 2, 4, 8 KiB
QUICK = {"max_bytes": 4096, "budget_s": 6.0, "progress": False}
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _input_of(op: str, nbytes: int, dtype: Any, world: int, fill: float = 1.0) -> Any:
    """The input of ``op`` whose message (a collective's: the whole tensor, reduce-scatter's
    input, all-gather's output) is ``nbytes``."""
    numel = nbytes // dtype.itemsize
    return torch.full((numel // world if op == "all_gather" else numel,), fill, dtype=dtype)


def _every_op_is_right(ar: Any, nbytes: int, dtype: Any) -> bool:
    """Every operation (the fused one too) gives the group's result at this message size
    (rounded down to whole 16-byte chunks per rank, as a collective's must be)."""
    rank, world = ar.rank, ar.world_size
    total = world * (world + 1) / 2
    nbytes = nbytes // (world * 16) * (world * 16)
    x = _input_of("all_reduce", nbytes, dtype, world, rank + 1)
    ok = torch.equal(ar.all_reduce(x), torch.full_like(x, total))
    ok &= torch.equal(ar.reduce_scatter(x), torch.full((x.numel() // world,), total, dtype=dtype))
    part = _input_of("all_gather", nbytes, dtype, world, rank + 1)
    gathered = torch.arange(1, world + 1, dtype=dtype).repeat_interleave(part.numel())
    ok &= torch.equal(ar.all_gather(part), gathered)
    rows = x.view(-1, 4)
    y, residual = ar.all_reduce_add_rms_norm(
        rows, torch.ones_like(rows), torch.ones(4, dtype=dtype), 1e-6
    )
    ok &= torch.equal(residual, torch.full_like(rows, total + 1))
    ok &= torch.allclose(y.float(), torch.ones(rows.shape), atol=1e-2)
    return bool(ok)


def _tune_and_reopen(rank: int, world: int, cache_dir: str, force: bool) -> dict[str, Any]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.testing import DTYPES

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    before = ar.stats()["table_source"]
    ar.all_reduce(torch.ones(64))  # one service call before the tune
    report = ar.tune(force=force, **QUICK)
    after_tune = ar.stats()
    choices = {}
    for c in report["choices"]:
        dtype = DTYPES[c["dtype"]]
        key = c["op"], c["dtype"], c["bytes"]
        choices[key] = ar.tactic(c["op"], _input_of(c["op"], c["bytes"], dtype, world))
        assert choices[key] == c["winner"], (choices, c)
        assert _every_op_is_right(ar, c["bytes"], dtype), c
    ar.destroy()
    again = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    reopened = {
        (op, d, b): again.tactic(op, _input_of(op, b, DTYPES[d], world)) for op, d, b in choices
    }
    stats = again.stats()
    again.destroy()
    return {
        "report": report,
        "before": before,
        "choices": choices,
        "reopened": reopened,
        "stats": stats,
        "after_tune": after_tune,
    }


def test_a_tune_writes_a_cache_the_next_communicator_loads_without_measuring(tmp_path, clean_shm):
    res = run_ranks(_tune_and_reopen, 2, str(tmp_path), False).values()
    report = res[0]["report"]
    assert report["status"] == "tuned" and report["measured"] > 0
    path = Path(report["path"])
    assert path.parent == tmp_path and path.name == f"{res[0]['stats']['fingerprint']}.csv"
    assert "seed" in res[0]["before"]
    # The thousands of measurement calls are not service: stats() shows the one real call.
    for r in res:
        assert sum(r["after_tune"]["calls"].values()) == 1 and r["after_tune"]["declines"] == {}
        assert r["after_tune"]["staged"] == 0
    # Every rank chose the same, and a new communicator on the same host uses the cache.
    assert res[0]["choices"] == res[1]["choices"] == res[0]["reopened"] == res[1]["reopened"]
    for r in res:
        assert "cache" in r["stats"]["table_source"] and str(path) in r["stats"]["table_source"]
    text = path.read_text()
    assert text.startswith("# pcie_allreduce tuning cache\n") and "# checksum " in text
    assert f"# measured: {report['measured']} " in text
    # Every admitted dtype and every op is tuned (not only bf16, not only the all-reduce), and
    # the measured times are kept as extra columns for every tuned bucket.
    assert {(c["op"], c["dtype"]) for c in report["choices"]} == {
        (op, d) for op in OPS for d in ("bf16", "fp16", "fp32")
    }
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("host_shm,2,") and line.split(",")[2] != "*"
    ]
    assert len(rows) == len(report["choices"]) >= 27
    assert all(len(row.split(",")) == 16 for row in rows)
    for op in OPS[1:]:
        assert sum(row.split(",")[5].startswith(f"{op}:") for row in rows) >= 9


SEED_CHOICE = "oneshot/push/unstaged/flag/b1/t32"  # the seed table's host row below 32 KiB
NEAR = "twoshot/push/unstaged/flag/b1/t32"  # 1 % faster than the seed choice: within noise
CLEAR = "oneshot/pull/unstaged/flag/b1/t32"  # 30 % faster at 8 KiB: a real win


def _synthetic_costs(rank: int, seed: int):
    """Known costs with the noise of a shared machine: every block of calls is off by a few
    percent, and whole stretches run up to 2x slow or fast (the machine's phases)."""
    import random

    rng = random.Random(seed * 7919 + rank)
    state = {"phase": 1.0, "blocks": 0}

    def timer(label: str, size: int, op: str) -> float:
        state["blocks"] += 1
        if state["blocks"] % 40 == 0:
            state["phase"] = rng.uniform(0.6, 2.0)
        # The collectives' seed choice is NEAR's tactic: it stays, 14 % ahead of the rest.
        base = {SEED_CHOICE: 10.0, NEAR: 9.9, "fallback": 30.0}.get(label, 14.0)
        if size == 8192 and label == CLEAR and op == "all_reduce":
            base = 7.0
        return base * 1e-6 * state["phase"] * rng.lognormvariate(0.0, 0.03)

    return timer


def _tune_twice(rank: int, world: int, cache_dir: str) -> list[dict[str, Any]]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.tuning import tuner

    out = []
    for attempt in range(2):
        tuner.synthetic_timer = _synthetic_costs(rank, attempt)
        ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
        report = ar.tune(dtypes=["bf16"], force=True, max_bytes=8192, budget_s=20.0, progress=False)
        mine = [c for c in report["choices"] if c["op"] == "all_reduce"]
        out.append(
            {
                "winners": {c["bytes"]: c["winner"] for c in mine},
                "incumbents": {c["bytes"]: c["incumbent"] for c in mine},
                "edges": [(c["min_bytes"], c["max_bytes"]) for c in mine],
                "collectives": {
                    (c["op"], c["bytes"]): (c["incumbent"], c["winner"])
                    for c in report["choices"]
                    if c["op"] != "all_reduce"
                },
                "source": ar.stats()["table_source"],
            }
        )
        ar.destroy()
    tuner.synthetic_timer = None
    third = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    cached = third.tune(**QUICK)
    # Bucket edges: min_bytes inclusive, max_bytes exclusive.
    edges = {}
    for lo, hi in out[1]["edges"]:
        for b in (lo, hi - 16) if hi > 0 else (lo, 2 * lo):
            if b > 0:
                edges[b] = third.chosen_tactic(torch.ones(b // 2, dtype=torch.bfloat16))
    third.destroy()
    out.append({"status": cached["status"], "measured": cached["measured"], "edges": edges})
    return out


def test_two_tunes_of_one_host_choose_the_same_and_a_third_measures_nothing(tmp_path, clean_shm):
    """Driven by known costs and heavy noise (the real timer on this 2-core machine is too
    noisy to assert on): a 1 % win never displaces the incumbent, a 30 % win does, in the first
    tune, and the second tune (starting from the first one's cache) changes nothing."""
    first, second, third = run_ranks(_tune_twice, 2, str(tmp_path)).values()[0]
    assert set(first["incumbents"].values()) == {SEED_CHOICE}
    assert first["winners"] == {
        1024: SEED_CHOICE,
        2048: SEED_CHOICE,
        4096: SEED_CHOICE,
        8192: CLEAR,
    }
    assert "cache" in second["source"]
    assert second["incumbents"] == first["winners"] == second["winners"]
    # The collectives: measured at every bucket, and their incumbent stays in both tunes.
    assert sorted(first["collectives"]) == [
        (op, b) for op in ("all_gather", "reduce_scatter") for b in (1024, 2048, 4096, 8192)
    ]
    assert set(first["collectives"].values()) == {(NEAR, NEAR)}
    assert second["collectives"] == first["collectives"]
    assert third["status"] == "cached" and third["measured"] == 0
    # Every bucket's first and last size take that bucket's row.
    (lo1, hi1), (lo2, hi2), (lo3, hi3), (lo4, hi4) = first["edges"]
    assert lo1 == 0 and hi1 == lo2 and hi2 == lo3 and hi3 == lo4 and hi4 == -1
    assert third["edges"][hi3 - 16] == SEED_CHOICE and third["edges"][lo4] == CLEAR


# Known costs for every op: the incumbents (SEED_CHOICE for the all-reduce, NEAR's two-shot for
# the collectives) win everywhere but at two places, where the table must follow the timings.
EDGE = 1440  # the 1 KiB bucket's end: the group's own reduce-scatter is fastest below it
AG_WIN = "twoshot/pull/unstaged/flag/b2/t32"  # the fastest all-gather from the 2 KiB bucket on
WRONG = "twoshot/push/staged/flag/b1/t32"  # rank 1's reduce-scatter is one bit off on this one


def _every_op_costs(label: str, size: int, op: str) -> float:
    if op == "reduce_scatter" and label == "fallback" and size < EDGE:
        return 5e-6
    if op == "all_gather" and label == AG_WIN and size >= EDGE:
        return 6e-6
    incumbent = SEED_CHOICE if op == "all_reduce" else NEAR
    return {incumbent: 10e-6, "fallback": 30e-6}.get(label, 14e-6)


def _tune_every_op(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.tuning import tuner

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    if rank == 1:  # a tactic that gets one bit wrong on one rank
        right = ar.reduce_scatter

        def one_bit_off(x: Any, out: Any = None) -> Any:
            y = right(x, out=out)
            if ar.tactic("reduce_scatter", x) == WRONG:
                y.view(torch.int16)[0] ^= 1
            return y

        ar.reduce_scatter = one_bit_off
    tuner.synthetic_timer = _every_op_costs
    report = ar.tune(dtypes=["bf16"], force=True, max_bytes=2048, budget_s=1.0, progress=False)
    tuner.synthetic_timer = None
    if rank == 1:
        del ar.reduce_scatter
    bf16 = torch.bfloat16
    got = {}
    for c in report["choices"]:
        x = _input_of(c["op"], c["bytes"], bf16, world)
        got[c["op"], c["bytes"]] = {
            "bucket": (c["min_bytes"], c["max_bytes"]),
            "winner": c["winner"],
            "incumbent": c["incumbent"],
            "tactic": ar.tactic(c["op"], x),
            "collective": None
            if c["op"] == "all_reduce"
            else ar.chosen_collective_tactic(x, c["op"]),
            "right": _every_op_is_right(ar, c["bytes"], bf16),
        }
    # Streamed sizes (16x the workspace) take the last bucket's row, which has no upper bound.
    big = 16 * MAX_NUMEL * 2 // (world * 16) * (world * 16)
    streamed = {op: ar.tactic(op, _input_of(op, big, bf16, world)) for op in OPS}
    streamed_right = _every_op_is_right(ar, big, bf16)
    ar.destroy()
    text = Path(report["path"]).read_text()
    return {
        "got": got,
        "excluded": report["excluded"],
        "streamed": streamed,
        "streamed_right": streamed_right,
        "rows": [r for r in text.splitlines() if r.startswith(f"host_shm,{world},bf16,")],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_tune_measures_every_op_against_its_own_fallback(world, tmp_path, clean_shm):
    """The reduce-scatter and the all-gather are measured like the all-reduce, each against the
    group's own collective: the installed table follows the timings for each op (the fallback
    for the reduce-scatter at 1 KiB, a pulled all-gather from 2 KiB), a tactic one bit off on
    one rank is excluded and named with its op, and every op stays right. At world 3 each
    collective's size is a multiple of 3 x 16 bytes."""
    res = run_ranks(_tune_every_op, world, str(tmp_path)).values()
    assert all(r["got"] == res[0]["got"] for r in res)
    got, step = res[0]["got"], world * 16
    sizes = [b // step * step for b in (1024, 2048)]
    assert sorted(got) == sorted(
        [("all_reduce", b) for b in (1024, 2048)] + [(op, b) for op in OPS[1:] for b in sizes]
    )
    for (op, size), c in got.items():
        assert c["tactic"] == c["winner"] and c["right"], (op, size, c)
        assert c["collective"] in (None, c["winner"])
        lo, hi = c["bucket"]
        assert lo <= size and (hi < 0 or size < hi)
        if op == "reduce_scatter" and size < EDGE:
            assert c["collective"] == "fallback"
        elif op == "all_gather" and size >= EDGE:
            assert c["collective"] == AG_WIN
        else:
            assert c["winner"] == c["incumbent"] == (SEED_CHOICE if op == "all_reduce" else NEAR)
    for r in res:
        assert r["streamed"] == {
            "all_reduce": SEED_CHOICE,
            "reduce_scatter": NEAR,
            "all_gather": AG_WIN,
        }
        assert r["streamed_right"]
        assert r["excluded"] == [
            {"op": "reduce_scatter", "tactic": WRONG, "dtype": "bf16", "bytes": b, "ranks": [1]}
            for b in sizes
        ]
    # The table holds each op's measured rows, the collectives' with their prefix.
    algorithms = [row.split(",")[5] for row in res[0]["rows"]]
    assert len(algorithms) == 6 and all(len(row.split(",")) == 16 for row in res[0]["rows"])
    prefixes = [a.split(":")[0] for a in algorithms if ":" in a]
    assert prefixes == ["reduce_scatter"] * 2 + ["all_gather"] * 2
    assert "reduce_scatter:fallback" in algorithms
    assert any(
        row.split(",")[5:11] == ["all_gather:twoshot", "pull", "0", "2", "32", "flag"]
        for row in res[0]["rows"]
    )


def test_a_tune_of_some_ops_replaces_only_their_rows():
    """The rows a tune keeps from the table in use: everything but the tuned ops' rows of the
    tuned dtypes at this topology and world (an all-reduce-only tune keeps the collectives')."""
    from pcie_allreduce.tuning.tuner.table import untuned_rows

    rows = [
        "host_shm,2,bf16,0,*,oneshot,push,0,1,32",
        "host_shm,2,bf16,0,*,reduce_scatter:fallback",
        "host_shm,2,bf16,0,*,all_gather:twoshot,pull,0,2,32",
        "host_shm,2,fp16,0,*,reduce_scatter:twoshot,push,0,1,32",
        "host_shm,3,bf16,0,*,all_gather:twoshot,push,0,1,32",
        "host_shm,2,*,0,*,reduce_scatter:twoshot,push,0,1,32",
    ]

    def kept(ops: list[str]) -> list[str]:
        text = untuned_rows("\n".join(rows), "host_shm", 2, ["bf16"], ops)
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert kept(["all_reduce"]) == rows[1:]
    assert kept(["reduce_scatter"]) == rows[:1] + rows[2:]
    assert kept(list(OPS)) == rows[3:]


def test_a_collective_is_measured_at_whole_16_byte_chunks_per_rank():
    from pcie_allreduce.tuning.tuner import message_size

    assert message_size("all_reduce", 1040, 3) == 1040
    assert message_size("reduce_scatter", 1024, 3) == 1008
    assert message_size("all_gather", 2048, 3) == 2016
    assert message_size("all_gather", 2048, 8) == 2048
    assert message_size("reduce_scatter", 32, 3) == 0


def _bad_cache(rank: int, world: int, cache_dir: str, damage: str) -> dict[str, Any]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.tuning import cache, tuner

    tuner.synthetic_timer = _synthetic_costs(rank, 0)
    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    ar.tune(dtypes=["bf16"], force=True, max_bytes=8192, budget_s=5.0, progress=False)
    path = cache.cache_path(ar.stats()["fingerprint"])
    ar.destroy()
    if rank == 0:
        text = path.read_bytes()
        if damage == "truncated":
            path.write_bytes(text[: len(text) // 2])
        elif damage == "corrupt":
            path.write_bytes(text.replace(b"oneshot,pull", b"oneshot,push"))
        elif damage == "foreign":  # a whole, valid cache of another host, copied over
            rows = "host,4,*,0,*,twoshot,push,0,1,32\n"
            cache.write_cache(path, "host-w4-0123456789ab", {"devices": []}, rows, 1)
        elif damage == "binary":
            path.write_bytes(bytes(range(256)) * 4)
    import torch.distributed as dist

    dist.barrier()
    reopened = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    source = reopened.stats()["table_source"]
    sums_ok = bool(
        torch.equal(reopened.all_reduce(torch.ones(64) * (rank + 1)), torch.full((64,), 3.0))
    )
    retuned = reopened.tune(dtypes=["bf16"], max_bytes=8192, budget_s=5.0, progress=False)
    reopened.destroy()
    tuner.synthetic_timer = None
    found = cache.read_cache(path, retuned and reopened.stats()["fingerprint"])
    return {
        "source": source,
        "sums_ok": sums_ok,
        "retuned": retuned["status"],
        "valid_after": found.text is not None,
    }


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "foreign", "binary"])
def test_a_damaged_cache_is_reported_ignored_and_replaced_by_the_next_tune(
    damage, tmp_path, clean_shm, capfd
):
    for r in run_ranks(_bad_cache, 2, str(tmp_path), damage).values():
        assert "seed" in r["source"] and r["sums_ok"]
        assert r["retuned"] == "tuned" and r["valid_after"]
    words = {
        "truncated": "truncated",
        "corrupt": "checksum",
        "foreign": "foreign",
        "binary": "not UTF-8",
    }
    err = capfd.readouterr().err
    assert "ignoring the tuning cache" in err and words[damage] in err


def _racing_groups(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    """Two world-2 groups on one host (ranks 0-1 and 2-3) tune at the same moment."""
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    import torch.distributed as dist

    from pcie_allreduce import PcieAllReduce

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    ar = PcieAllReduce(mine, "cpu", max_numel=MAX_NUMEL, cpu_group=mine)
    dist.barrier()
    report = ar.tune(**QUICK)
    ar.destroy()
    return {"status": report["status"], "measured": report["measured"], "path": report["path"]}


def test_two_servers_tuning_one_host_at_once_measure_once_and_share_the_file(tmp_path, clean_shm):
    res = run_ranks(_racing_groups, 4, str(tmp_path)).values()
    statuses = sorted({(r["status"], r["measured"] > 0) for r in res})
    assert statuses == [("cached", False), ("tuned", True)], res
    assert len({r["path"] for r in res}) == 1
    from pcie_allreduce.tuning import cache

    path = Path(res[0]["path"])
    fp = path.name[: -len(".csv")]
    assert cache.read_cache(path, fp).text is not None
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _refused(rank: int, world: int, how: str) -> str:
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.errors import TuneRefused
    from pcie_allreduce.tuning import autotune_pass

    if how == "env" and rank == 1:
        os.environ["PCIE_ALLREDUCE_DISABLE_AUTOTUNE"] = "1"
    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL, enabled=how != "disabled")
    try:
        if how == "nested" and rank == 1:
            with autotune_pass("an engine warm-up"):
                ar.tune(**QUICK)
        else:
            ar.tune(**QUICK)
    except TuneRefused as error:
        return str(error)
    finally:
        ar.destroy()
    return "tuned"


@pytest.mark.parametrize(
    "how,words",
    [
        ("env", "rank 1: PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1"),
        ("nested", "rank 1: inside another autotune pass (an engine warm-up)"),
        ("disabled", "rank 0: the communicator is disabled"),
    ],
)
def test_tune_refuses_on_every_rank_saying_why_and_measures_nothing(
    how, words, tmp_path, clean_shm
):
    env = {"PCIE_ALLREDUCE_CACHE_DIR": str(tmp_path)}
    for message in run_ranks(_refused, 2, how, env=env).values():
        assert words in message and "measured nothing" in message
    assert list(tmp_path.glob("*.csv")) == []


def _table_disagreement(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.tuning import tuner

    tuner.synthetic_timer = _synthetic_costs(rank, 0)
    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    ar.tune(dtypes=["bf16"], max_bytes=2048, budget_s=3.0, progress=False)
    ar.destroy()
    # Rank 1 is handed the seed table explicitly; rank 0 finds the cache.
    table = "host,*,*,0,*,oneshot,push,0,1,32\n" if rank == 1 else None
    again = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL, table=table)
    out = {
        "enabled": again.enabled,
        "reason": again.disabled_reason,
        "sum": again.all_reduce(torch.ones(8) * (rank + 1)).tolist(),
    }
    again.destroy()
    return out


def test_ranks_holding_different_tables_are_detected_and_stay_correct(tmp_path, clean_shm):
    for r in run_ranks(_table_disagreement, 2, str(tmp_path)).values():
        assert not r["enabled"] and "table_hash" in r["reason"] and "rank 1" in r["reason"]
        assert r["sum"] == [3.0] * 8


def test_buckets_cover_every_size_once_with_edges_on_16_bytes():
    from pcie_allreduce.tuning.tuner import buckets

    got = buckets(65536)
    assert [b[1] for b in got] == [1024 << k for k in range(7)]
    assert got[0][0] == 0 and got[-1][2] == -1
    for (lo, size, hi), nxt in zip(got, got[1:]):
        assert lo <= size < hi == nxt[0] and hi % 16 == 0
    assert buckets(512) == [(0, 512, -1)]


def test_the_incumbent_stays_unless_beaten_by_more_than_the_noise():
    from pcie_allreduce.tuning.decision import keep_or_replace

    inc = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0]  # the machine's phases, shared by both
    assert keep_or_replace("a", {"a": inc, "b": [t * 0.98 for t in inc]})[0] == "a"
    assert keep_or_replace("a", {"a": inc, "b": [t * 0.80 for t in inc]})[0] == "b"
    noisy = [t * f for t, f in zip(inc, (0.7, 1.2, 0.8, 1.3, 0.6, 1.1))]
    assert keep_or_replace("a", {"a": inc, "b": noisy})[0] == "a"  # median 0.95, noise 20 %
    assert keep_or_replace(None, {"a": inc, "b": [t * 0.98 for t in inc]})[0] == "b"


def _bad_arguments(rank: int, world: int) -> list[str]:
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL, dtypes=("bf16", "fp32"))
    messages = []
    for kwargs in (
        {"dtypes": ["int8"]},
        {"dtypes": []},
        {"max_bytes": 8.5},
        {"budget_s": 0},
        {"budget_s": float("nan")},
    ):
        try:
            ar.tune(**kwargs)
            messages.append(f"accepted {kwargs}")
        except ValueError as error:
            messages.append(str(error))
    from pcie_allreduce.tuning import tuner

    for ops in ("all_reduce", [], ["all_reduce_add_rms_norm"], ["all_reduce", "broadcast"]):
        try:
            tuner.tune(ar, ops=ops)
            messages.append(f"accepted ops={ops!r}")
        except ValueError as error:
            messages.append(str(error))
    ar.destroy()
    return messages


def test_bad_tune_arguments_raise_before_any_exchange_saying_what_was_expected(clean_shm):
    messages = run_ranks(_bad_arguments, 2).values()[0]
    assert (
        "expected a non-empty subset of the communicator's dtypes ['bf16', 'fp32']" in messages[0]
        and "int8" in messages[0]
    )
    assert "expected a non-empty subset" in messages[1]
    assert "max_bytes=8.5" in messages[2] and "whole number of bytes" in messages[2]
    assert all("positive number of seconds" in m for m in messages[3:5])
    for m in messages[5:]:
        assert (
            "tune(ops=" in m
            and (
                "expected a non-empty sequence of operations from "
                "['all_reduce', 'reduce_scatter', 'all_gather']"
            )
            in m
        ), m


def _replace_table(rank: int, world: int) -> dict[str, Any]:
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    x = torch.ones(512, dtype=torch.bfloat16) * (rank + 1)
    before = ar.chosen_tactic(x)
    try:
        ar.install_table("host,2,bf16,0,*,oneshot,sideways,0,1,32\n", "broken")
        refused = ""
    except ValueError as error:
        refused = str(error)
    kept = (ar.chosen_tactic(x), ar.stats()["table_source"])
    # A first row the workspace cannot run (blocks above the host cap) is skipped; then the
    # wildcard row decides.
    ar.install_table(
        "host,2,bf16,0,*,twoshot,push,0,64,32\n*,*,*,0,*,twoshot,pull,1,2,32\n", "replacement"
    )
    after = ar.chosen_tactic(x)
    total = ar.all_reduce(x)
    ar.destroy()
    return {
        "before": before,
        "refused": refused,
        "kept": kept,
        "after": after,
        "sum_ok": bool(torch.equal(total, torch.full((512,), 3.0, dtype=torch.bfloat16))),
    }


def test_a_replaced_table_takes_the_next_call_and_a_bad_one_keeps_the_old(clean_shm):
    for r in run_ranks(_replace_table, 2).values():
        assert "broken line 1" in r["refused"] and "sideways" in r["refused"]
        assert r["kept"] == (r["before"], "embedded seed table")
        assert r["after"] == "twoshot/pull/staged/flag/b2/t32" and r["sum_ok"]


def test_the_cache_loader_never_raises_on_damaged_files(tmp_path):
    """A bounded mutation fuzz of the cache loader: flipped, dropped and inserted bytes, cut
    files. Every outcome is a usable table or a stated problem, never an exception."""
    import random

    from pcie_allreduce import _C
    from pcie_allreduce.tuning import cache

    fp = "host-w2-0123456789ab"
    path = tmp_path / f"{fp}.csv"
    rows = "host,2,bf16,0,4096,oneshot,push,0,1,32,flag,1.0\nhost,2,*,4096,*,fallback,,,,\n"
    cache.write_cache(path, fp, {"devices": ["cpu"]}, rows, 2)
    good = path.read_bytes()
    assert cache.read_cache(path, fp).text is not None
    rng = random.Random(10)
    outcomes = set()
    for _ in range(600):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            kind = rng.randrange(4)
            if kind == 0:
                data[at] = rng.randrange(256)
            elif kind == 1:
                del data[at]
            elif kind == 2:
                data.insert(at, rng.randrange(256))
            else:
                del data[at:]
                break
        path.write_bytes(bytes(data))
        found = cache.read_cache(path, fp)
        assert (found.text is None) != (found.problem is None) or bytes(data) == good
        if found.text is not None:
            _C.TuningTable.parse(found.text, "cache")  # a table it hands out always parses
        outcomes.add((found.problem or "valid").split(" ")[0])
    assert {"truncated", "corrupt"} <= outcomes


def _rounds_under(
    rank: int, world: int, cache_dir: str, budget_s: float, ops: list[str] | None
) -> list[int]:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.tuning import tuner

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    report = tuner.tune(
        ar, dtypes=["bf16"], force=True, max_bytes=4096, budget_s=budget_s, progress=False, ops=ops
    )
    ar.destroy()
    assert {c["op"] for c in report["choices"]} == set(ops or OPS)
    return [c["rounds"] for c in report["choices"]]


def test_a_small_budget_stops_the_rounds_instead_of_being_overrun(tmp_path, clean_shm):
    """Ten rounds per bucket always ran, so a tune overran its budget 5-10x; a spent budget now
    stops a bucket after three rounds (every rank alike: the stop is computed from gathered
    numbers), and a generous one still runs at least the ten."""
    tight = run_ranks(_rounds_under, 2, str(tmp_path / "tight"), 0.02, None).values()
    assert tight[0] == tight[1] and len(tight[0]) == 9 and set(tight[0]) == {3}, tight
    # Generous: five times QUICK's (twelve host tactics at world 2 since lamport joined, on a
    # 2-core machine that may be busy with other work), for the all-reduce alone (each op's
    # buckets run the same rounds; three ops would triple the time, not the coverage).
    roomy = run_ranks(
        _rounds_under, 2, str(tmp_path / "roomy"), 5 * QUICK["budget_s"], ["all_reduce"]
    ).values()
    assert roomy[0] == roomy[1] and min(roomy[0]) >= 10, roomy
