"""Session setup for the tests against the real vLLM (helpers: vllm_harness.py). Run by
.ci/engine-vllm in .venv-vllm (vLLM installed without its CUDA dependencies)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import vllm_harness as h

# No test reads or writes the developer's tuning cache; spawned ranks inherit this folder. Each
# test states the flags it runs with; the vLLM CPU environment holds in this process too.
_CACHE = tempfile.mkdtemp(prefix="pcie_ar_vllm_test_cache.")
os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
for _name, _value in h.VLLM_CPU_ENV.items():
    os.environ.setdefault(_name, _value)
for _name in h.FLAGS_UNDER_TEST:
    os.environ.pop(_name, None)


@pytest.fixture
def clean_shm():
    """Asserts the ranks this test spawned left no pcie_allreduce segment in /dev/shm."""
    before, first = h.shm_entries(), len(h.SPAWNED_PIDS)
    yield
    leaked = h.leaked_since(before, first)
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"
