"""The rules every caller shares (pcie_allreduce.policy): one transport vocabulary, the table key,
the fingerprint, where a table comes from, and one rule for the workspace size."""

from __future__ import annotations

import pytest
from conftest import run_ranks

from pcie_allreduce import policy


def test_every_spelling_of_a_transport_reads_as_its_one_name():
    for spellings, name in (
        (("host_shm", "host", " HOST "), "host_shm"),
        (("cuda_ipc", "cuda", "p2p", "P2P"), "cuda_ipc"),
        (("cuda_host", "hostmem", "HostMem"), "cuda_host"),
        (("auto", "", None), "auto"),
    ):
        for spelling in spellings:
            assert policy.canonical(spelling) == name, spelling
    with pytest.raises(
        ValueError,
        match="transport must be one of auto, host_shm, cuda_ipc, "
        r"cuda_host \(or host = host_shm, cuda = cuda_ipc, p2p = cuda_ipc, "
        r"hostmem = cuda_host\), got 'nvlink'",
    ):
        policy.canonical("nvlink")


def test_the_vocabulary_agrees_with_the_extensions():
    from pcie_allreduce import _C

    if not hasattr(_C, "transport_names"):
        pytest.skip("this _C predates _C.transport_names()")
    ours = {name: sorted(aliases) for name, aliases in policy.transport_names().items()}
    theirs = {name: sorted(aliases) for name, aliases in _C.transport_names().items()}
    assert ours == theirs
    for legacy, key in policy.LEGACY_TABLE_KEYS.items():
        assert _C.TuningTable.canonical_key(legacy) == key == policy.canonical_table_key(legacy)
    options = _C.Options()
    for spelling, name in (*((n, n) for n in policy.TRANSPORTS), *policy.ALIASES.items()):
        options.transport = spelling
        assert options.transport == name, spelling


def test_cpu_tensors_run_host_shm_and_gpus_start_on_what_was_asked():
    assert policy.choose_transport("cpu", None, "cuda_host").name == "host_shm"
    assert policy.choose_transport("cpu", "host", "auto").name == "host_shm"
    for asked in ("hostmem", "cuda_ipc"):
        with pytest.raises(ValueError, match="chooses how GPUs reach each other"):
            policy.choose_transport("cpu", asked, "auto", "cpu")
    with pytest.raises(ValueError, match="is the CPU tensors' transport"):
        policy.choose_transport("cuda", "host_shm", "auto", "cuda:0")
    auto = policy.choose_transport("cuda", None, "auto")
    assert (auto.name, auto.mode) == ("cuda_ipc", "auto")
    forced = policy.choose_transport("cuda", "hostmem", "auto")
    assert (forced.name, forced.mode) == ("cuda_host", "cuda_host")
    assert forced.detail() == "transport='cuda_host': every workspace in shared pinned host memory"
    assert (
        policy.choose_transport("cuda", None, "cuda_host")
        .detail()
        .startswith("PCIE_ALLREDUCE_TRANSPORT=cuda_host: ")
    )
    assert policy.transport_after_p2p_failure("auto") == "cuda_host"
    assert policy.transport_after_p2p_failure("cuda_ipc") is None


def test_table_keys_name_the_transports_that_have_their_own_rows():
    assert policy.table_key("host_shm") == "host_shm"
    assert policy.table_key("cuda_host", "islands-2x4") == "cuda_host"
    assert policy.table_key("cuda_host", "nvlink") == "nvlink"  # declines either way
    assert policy.table_key("cuda_ipc", "islands-2x4") == "islands-2x4"
    assert policy.canonical_table_key("host") == "host_shm"
    assert policy.canonical_table_key("hostmem") == "cuda_host"


def test_a_fingerprint_starts_with_the_transports_one_name_whatever_the_spelling_given():
    legacy = policy.fingerprint_fields("host", 2, "host", [], ["cpu"])
    canonical = policy.fingerprint_fields("host_shm", 2, "host_shm", [], ["cpu"])
    assert legacy == canonical and canonical["topology"] == "host_shm"
    assert policy.fingerprint(canonical).startswith("host_shm-w2-")
    assert policy.driver_field(None, "12.8") == "cuda 12.8"
    assert policy.driver_field("", "12.8") == "driver unknown, cuda 12.8"


def test_a_table_argument_beats_the_flag_which_beats_the_cache_or_seed():
    assert not policy.table_request(None, None).given
    assert policy.table_request(None, None).source == "embedded seed table"
    env = policy.table_request(None, "/t.csv")
    assert (env.path, env.source) == ("/t.csv", "PCIE_ALLREDUCE_TABLE /t.csv")
    given = policy.table_request("/x.csv", "/t.csv")
    assert (given.path, given.source) == ("/x.csv", "table file /x.csv")
    assert policy.table_request("*,*,*,0,*,fallback\n", None).text is not None
    with pytest.raises(ValueError, match="table must be CSV text or a path"):
        policy.table_request("  ", None)


def test_the_workspace_size_has_one_rule_whoever_gives_it():
    explicit = policy.size_workspace(explicit=4096, from_env=8192, hidden=10, max_rows=10)
    assert (explicit.max_numel, explicit.source) == (4096, "max_numel")
    assert policy.size_workspace(from_env=8192, hidden=10, max_rows=10).max_numel == 8192
    derived = policy.size_workspace(hidden=4100, max_rows=1)
    assert derived.max_numel == 4104 and "rounded up to 4104" in derived.how
    guess = policy.size_workspace(hidden=100)
    assert guess.guessed and guess.max_numel == 6400 and "guessing 64 rows" in guess.how
    assert policy.size_workspace().max_numel == 64 * 8192
    for value in (4100, 0, -8, 1 << 32):
        with pytest.raises(
            ValueError,
            match=r"max_numel must be a positive multiple of 8 "
            rf"\(elements\), got {value}",
        ):
            policy.size_workspace(explicit=value)
    with pytest.raises(ValueError, match="more than the 4294967288 elements"):
        policy.size_workspace(hidden=1 << 20, max_rows=1 << 13)


def _derived_size(rank: int, world: int) -> dict:
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", hidden=4100, max_rows=1, dtypes=("bf16",))
    out = {"max_numel": ar.max_numel}
    ar.destroy()
    try:
        PcieAllReduce(None, "cpu", max_numel=4100, dtypes=("bf16",))
    except ValueError as error:  # before any exchange
        out["explicit"] = str(error)
    return out


def test_a_size_derived_from_rows_and_hidden_is_rounded_up_and_a_given_one_is_checked():
    """hidden 4100 x 1 row of bf16 is 8200 bytes, not whole 16-byte vectors: the workspace
    holds 4104 elements instead of failing in the extension's layout after the handshake."""
    out = run_ranks(_derived_size, 1).values()[0]
    assert out["max_numel"] == 4104
    assert "max_numel must be a positive multiple of 8 (elements), got 4100" in out["explicit"]
