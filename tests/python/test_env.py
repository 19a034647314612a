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
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": " HostMem "}).transport == "hostmem"
    assert read_env({"PCIE_ALLREDUCE_TRANSPORT": "p2p"}).transport == "p2p"


def test_values_parse():
    e = read_env({
        "PCIE_ALLREDUCE_ENABLE": "1",
        "PCIE_ALLREDUCE_MAX_NUMEL": "393216",
        "PCIE_ALLREDUCE_TIMEOUT_S": "0",
        "PCIE_ALLREDUCE_LOG_LEVEL": "debug",
    })
    assert e.enable and e.max_numel == 393216 and e.timeout_s == 0.0 and e.log_level == 2


@pytest.mark.parametrize(
    "name,value,expect",
    [
        ("PCIE_ALLREDUCE_MAX_NUMEL", "abc", "positive multiple of 8 (elements), got 'abc'"),
        ("PCIE_ALLREDUCE_MAX_NUMEL", "12", "positive multiple of 8"),
        ("PCIE_ALLREDUCE_TIMEOUT_S", "-1", "seconds >= 0"),
        ("PCIE_ALLREDUCE_ENABLE", "maybe", "must be 1/0"),
        ("PCIE_ALLREDUCE_LOG_LEVEL", "loud", "0/1/2"),
        ("PCIE_ALLREDUCE_HOST_REDUCE", "sse2", "one of auto, scalar, avx2, avx512, got 'sse2'"),
        ("PCIE_ALLREDUCE_TRANSPORT", "nvlink", "one of auto, p2p, hostmem, got 'nvlink'"),
    ],
)
def test_bad_values_say_what_was_expected(name, value, expect):
    with pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        read_env({name: value})
