"""Environment flags: one reader, clear errors."""

import pytest

from pcie_allreduce.env import read_env


def test_defaults():
    e = read_env({})
    assert e.enable is None and e.max_numel is None and e.timeout_s == 30.0
    assert e.log_level == 1


def test_host_reduce_names_the_kernels_or_auto():
    assert read_env({}).host_reduce is None
    assert read_env({"PCIE_ALLREDUCE_HOST_REDUCE": "auto"}).host_reduce is None
    assert read_env({"PCIE_ALLREDUCE_HOST_REDUCE": " AVX2 "}).host_reduce == "avx2"


def test_transport_is_auto_p2p_or_hostmem():
    assert read_env({}).transport == "auto"
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": ""}).transport == "auto"
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": " HostMem "}).transport == "cuda_host"
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": "p2p"}).transport == "cuda_ipc"


def test_values_parse():
    e = read_env(
        {
            "PCIE_ALLREDUCE_ENABLE": "1",
            "PCIE_ALLREDUCE_MAX_NUMEL": "393216",
            "PCIE_ALLREDUCE_TIMEOUT_S": "0",
            "PCIE_ALLREDUCE_LOG_LEVEL": "debug",
        }
    )
    assert e.enable and e.max_numel == 393216 and e.timeout_s == 0.0 and e.log_level == 2


@pytest.mark.parametrize(
    "name,value,expect",
    [
        ("PCIE_ALLREDUCE_MAX_NUMEL", "abc", "positive multiple of 8 (elements), got 'abc'"),
        ("PCIE_ALLREDUCE_MAX_NUMEL", "12", "positive multiple of 8"),
        ("PCIE_ALLREDUCE_TIMEOUT_S", "-1", "seconds >= 0"),
        # 1e10 passed here and overflowed at construction (OverflowError) before.
        (
            "PCIE_ALLREDUCE_TIMEOUT_S",
            "1e10",
            "at most 1000000000 (about 31 years; 0 waits forever), got '1e10'",
        ),
        ("PCIE_ALLREDUCE_TIMEOUT_S", "inf", "at most 1000000000"),
        ("PCIE_ALLREDUCE_ENABLE", "maybe", "must be 1/0"),
        ("PCIE_ALLREDUCE_LOG_LEVEL", "loud", "0/1/2"),
        ("PCIE_ALLREDUCE_HOST_REDUCE", "sse2", "one of auto, scalar, avx2, avx512, got 'sse2'"),
        (
            "PCIE_ALLREDUCE_TRANSPORT",
            "nvlink",
            "one of auto, cuda_ipc, cuda_host (or cuda = "
            "cuda_ipc, p2p = cuda_ipc, hostmem = cuda_host), got 'nvlink'",
        ),
        ("PCIE_ALLREDUCE_TRANSPORT", "host_shm", "one of auto, cuda_ipc, cuda_host"),
        ("PCIE_ALLREDUCE_PDL", "2", "PCIE_ALLREDUCE_PDL must be 1/0"),
        ("PCIE_ALLREDUCE_SELF_TEST", "maybe", "PCIE_ALLREDUCE_SELF_TEST must be 1/0"),
    ],
)
def test_bad_values_say_what_was_expected(name, value, expect):
    with pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        read_env({name: value})


def test_transport_names_are_canonical_whatever_the_spelling():
    for spelling in ("cuda_ipc", "CUDA", "p2p"):
        assert read_env({"PCIE_ALLREDUCE_TRANSPORT": spelling}).transport == "cuda_ipc"
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": "cuda_host"}).transport == "cuda_host"


def test_pdl_is_on_unless_turned_off():
    assert read_env({}).pdl and read_env({"PCIE_ALLREDUCE_PDL": ""}).pdl
    assert read_env({"PCIE_ALLREDUCE_PDL": "1"}).pdl
    assert not read_env({"PCIE_ALLREDUCE_PDL": "0"}).pdl
    assert not read_env({"PCIE_ALLREDUCE_PDL": " off "}).pdl


def test_the_self_test_is_on_unless_turned_off():
    assert read_env({}).self_test and read_env({"PCIE_ALLREDUCE_SELF_TEST": "1"}).self_test
    assert not read_env({"PCIE_ALLREDUCE_SELF_TEST": "0"}).self_test


def test_the_cache_folder_is_the_flag_else_xdg_else_home(tmp_path):
    from pathlib import Path

    assert (
        read_env(
            {"PCIE_ALLREDUCE_CACHE_DIR": str(tmp_path), "XDG_CACHE_HOME": "/x"}
        ).tuning_cache_dir()
        == tmp_path
    )
    assert read_env({"XDG_CACHE_HOME": "/x"}).tuning_cache_dir() == Path("/x/pcie_allreduce")
    assert read_env({}).tuning_cache_dir() == Path.home() / ".cache" / "pcie_allreduce"


def test_read_flags_reports_every_bad_flag_and_keeps_the_others():
    from pcie_allreduce.env import read_flags

    flags, problems = read_flags(
        {
            "PCIE_ALLREDUCE_TRANSPORT": "ipc",
            "PCIE_ALLREDUCE_TIMEOUT_S": "soon",
            "PCIE_ALLREDUCE_TABLE": "t.csv",
        }
    )
    assert set(problems) == {"PCIE_ALLREDUCE_TRANSPORT", "PCIE_ALLREDUCE_TIMEOUT_S"}
    assert "'ipc'" in problems["PCIE_ALLREDUCE_TRANSPORT"]
    assert flags.transport == "auto" and flags.timeout_s == 30.0 and flags.table == "t.csv"
