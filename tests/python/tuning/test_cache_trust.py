"""The tuning cache cannot be turned against its user, and a tune that cannot use it fails on
every rank alike.

Unguarded, a FIFO at the cache path would block rank 0 and doctor forever, a symlink to
/dev/zero would read until memory ran out, a planted symlink at the lock would make tune truncate
any file its user can write, a table planted by another user would be trusted, and a killed
writer's temporary file would stay. Each is tried here on real files (as root, the tests can
play the second user with chown)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import run_ranks

FP = "host_shm-w2-0123456789ab"
ROWS = (
    "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads,"
    "protocol\n*,*,*,0,*,fallback,,,,,\n"
)


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    return folder


def _valid_cache(folder: Path) -> Path:
    from pcie_allreduce.tuning import cache

    path = cache.cache_path(FP, folder)
    cache.write_cache(path, FP, {"devices": []}, ROWS, 1)
    assert cache.read_cache(path, FP).text is not None  # the control: as written, it is used
    return path


@pytest.mark.timeout(60)
def test_a_fifo_or_a_device_at_the_cache_path_is_refused_without_blocking(tmp_path):
    from pcie_allreduce.tuning import cache

    folder = _folder(tmp_path)
    path = cache.cache_path(FP, folder)
    os.mkfifo(path, 0o600)  # no writer ever comes: an open that blocks would hang here
    found = cache.read_cache(path, FP)
    assert found.text is None and "is a FIFO, expected a regular file" in found.problem, found
    path.unlink()
    path.symlink_to("/dev/zero")  # read to the end, this never ends
    found = cache.read_cache(path, FP)
    assert found.text is None and "is a symbolic link" in found.problem, found


def test_a_cache_file_larger_than_any_table_is_refused(tmp_path):
    from pcie_allreduce import files
    from pcie_allreduce.tuning import cache

    path = cache.cache_path(FP, _folder(tmp_path))
    path.write_bytes(b"#" * (files.MAX_FILE_BYTES + 1))
    path.chmod(0o600)
    found = cache.read_cache(path, FP)
    assert found.text is None and f"more than the {files.MAX_FILE_BYTES}" in found.problem, found


@pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs chown (root)")
def test_a_correctly_checksummed_table_of_another_user_is_not_trusted(tmp_path):
    from pcie_allreduce.tuning import cache

    path = _valid_cache(_folder(tmp_path))
    os.chown(path, 12345, 12345)
    found = cache.read_cache(path, FP)
    assert found.text is None and "belongs to uid 12345" in found.problem, found
    os.chown(path, 0, 0)
    path.chmod(0o666)
    found = cache.read_cache(path, FP)
    assert found.text is None and "writable by others (mode 666)" in found.problem, found


@pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs chown (root)")
def test_a_folder_others_can_write_or_another_user_owns_is_refused_for_reads_and_writes(tmp_path):
    from pcie_allreduce import files
    from pcie_allreduce.tuning import cache

    folder = _folder(tmp_path)
    path = _valid_cache(folder)
    folder.chmod(0o777)
    found = cache.read_cache(path, FP)
    assert found.text is None and "is writable by others (mode 777)" in found.problem, found
    assert "chmod go-w" in found.problem
    with pytest.raises(files.Refused, match="writable by others"):
        cache.write_cache(path, FP, {"devices": []}, ROWS, 1)
    folder.chmod(0o700)
    os.chown(folder, 12345, 12345)
    found = cache.read_cache(path, FP)
    assert found.text is None and "belongs to uid 12345" in found.problem, found


def test_a_symlink_planted_at_the_lock_is_refused_and_its_target_left_alone(tmp_path):
    from pcie_allreduce import files
    from pcie_allreduce.tuning import cache

    folder = _folder(tmp_path)
    victim = tmp_path / "precious"
    victim.write_text("keep me\n")
    path = cache.cache_path(FP, folder)
    Path(f"{path}.lock").symlink_to(victim)
    lock = cache.CacheLock(path)
    with pytest.raises(files.Refused, match="is a symbolic link"):
        lock.try_acquire()
    assert victim.read_text() == "keep me\n"  # truncated and overwritten with a pid before


def test_a_new_cache_folder_is_private_and_a_killed_writers_temporary_is_removed(tmp_path):
    from pcie_allreduce.tuning import cache

    folder = tmp_path / "new" / "cache"
    path = cache.cache_path(FP, folder)
    cache.write_cache(path, FP, {"devices": []}, ROWS, 1)
    assert folder.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600
    stale = folder / f".{path.name}.k1ll3d.tmp"  # what a writer killed mid-write leaves
    stale.write_text("half a table")
    cache.write_cache(path, FP, {"devices": []}, ROWS, 1)
    assert not stale.exists() and cache.read_cache(path, FP).text is not None
    assert sorted(p.name for p in folder.iterdir()) == [path.name]


@pytest.mark.timeout(60)
def test_a_fifo_named_as_the_operators_table_raises_instead_of_blocking(tmp_path):
    from pcie_allreduce import construction, policy

    fifo = tmp_path / "table.csv"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="is a FIFO, expected a regular file"):
        construction.read_table(policy.table_request(None, str(fifo)))


@pytest.mark.timeout(120)
def test_doctor_reports_a_fifo_in_the_cache_folder_and_still_gives_a_verdict(tmp_path):
    import json
    import subprocess
    import sys

    folder = _folder(tmp_path)
    os.mkfifo(folder / f"{FP}.csv", 0o600)
    done = subprocess.run(
        [sys.executable, "-m", "pcie_allreduce", "doctor", "--json", "--no-p2p-test"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PCIE_ALLREDUCE_CACHE_DIR": str(folder)},
    )
    report = json.loads(done.stdout)
    caches = report["table"]["host_caches"]
    assert [c["path"] for c in caches] == [str(folder / f"{FP}.csv")], caches
    assert caches[0]["status"] == "refused" and "is a FIFO" in caches[0]["problem"], caches


def _tune_into(rank: int, world: int, cache_dir: str) -> dict:
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.errors import TuneError

    ar = PcieAllReduce(None, "cpu", max_numel=4096, timeout_s=20.0)
    start = time.monotonic()
    try:
        ar.tune(dtypes=["bf16"], max_bytes=2048, budget_s=2.0, progress=False)
        said = "tuned"
    except TuneError as error:
        said = str(error)
    elapsed = time.monotonic() - start
    ar.destroy()
    return {"said": said, "elapsed": elapsed}


def test_an_unusable_cache_folder_fails_the_tune_on_every_rank_at_once(tmp_path, clean_shm):
    """Rank 0 raised a raw OSError at once while rank 1 waited out the whole timeout and then
    reported a timeout; now every rank raises the same TuneError promptly."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    res = run_ranks(_tune_into, 2, str(blocker / "cache"), timeout=120).values()
    assert res[0]["said"] == res[1]["said"], res
    assert (
        res[0]["said"].startswith("rank 0 cannot lock the cache")
        and "measured nothing" in res[0]["said"]
    ), res
    assert max(r["elapsed"] for r in res) < 10.0, res  # well inside the 20 s timeout
