"""The SGLang integration tests run in .venv-sglang (.ci/engine-sglang): the real SGLang 0.5.23
code, two spawned CPU ranks, POSIX shared memory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch.multiprocessing as mp
from sglang_ranks import shm_entries

# No test reads or writes the developer's tuning cache (~/.cache/pcie_allreduce): spawned ranks
# inherit this folder; the warm-up tests point PCIE_ALLREDUCE_CACHE_DIR at their own tmp_path.
if mp.parent_process() is None:
    _CACHE = tempfile.mkdtemp(prefix="pcie_ar_sglang_cache.")
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)


@pytest.fixture(autouse=True)
def clean_shm():
    """Every test leaves no pcie_allreduce segment in /dev/shm."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"
