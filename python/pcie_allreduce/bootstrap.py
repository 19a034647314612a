"""Construction-time exchanges between the ranks of a group, each bounded by the timeout.

``torch.distributed``'s object collectives block until every rank arrives (a rank that failed
and went on holds the others forever) and need numpy. Here every exchange is point-to-point
over the group's gloo ``cpu_group``: each rank sends its bytes to every peer and waits for
every peer's until a deadline, so when a rank does not arrive the others raise
:class:`PcieAllReduceTimeout` naming it, within the timeout, and nothing but torch is needed.

A failed exchange leaves unmatched messages in ``cpu_group`` (and a daemon thread blocked on
each): re-create the process group before constructing again after a construction error. At
interpreter exit those waits are aborted and their threads joined (``_Waits.close``), so no
thread of ours is inside gloo when the interpreter finalizes: a daemon thread woken there (its
peer exited) is ended with ``pthread_exit``, whose forced unwind through pybind11 aborts the
process.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .errors import PcieAllReduceTimeout

# gloo matches point-to-point messages by (peer, tag): one tag per kind of exchange, so a
# late message of one exchange is never taken for another.
_TAGS = {"length": 0x50410, "data": 0x50411, "leave": 0x50412}


# Sends nobody waits for (to or from a failed rank): alive for the life of the process, so
# gloo can still deliver them and the pair's later messages are not blocked.
_never_taken: list[Any] = []


class _Aborted(Exception):
    """A peer thread's wait was aborted at interpreter exit."""


class _Waits:
    """Every gloo wait a peer thread of this process is in, so that interpreter exit can end
    them (c10d's Work.abort) and join their threads before finalization."""

    # Joined threads get this long in all: an aborted wait returns at once.
    JOIN_S = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[int, Any] = {}  # thread ident -> the work it waits for
        self._threads: list[threading.Thread] = []
        self._closing = False

    def start(self, thread: threading.Thread) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def wait(self, work: Any) -> None:
        """work.wait(), unless interpreter exit aborted it (then _Aborted)."""
        me = threading.get_ident()
        with self._lock:
            if self._closing:
                raise _Aborted()
            self._current[me] = work
        try:
            completed = work.wait()
        finally:
            with self._lock:
                self._current.pop(me, None)
        if completed is False or self._closing:
            raise _Aborted()

    def close(self) -> None:
        """The exit hook: aborts every wait in progress and joins every peer thread."""
        with self._lock:
            self._closing = True
            works = list(self._current.values())
            threads = [t for t in self._threads if t.is_alive()]
        if not threads:
            return
        from .native import _C

        for work in works:
            try:
                _C.abort_work(work)
            except Exception:  # noqa: BLE001 - a work torch already finished needs nothing
                pass
        deadline = time.monotonic() + self.JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


_WAITS = _Waits()
atexit.register(_WAITS.close)


class Bootstrap:
    """Bounded gathers and barriers over ``cpu_group`` (gloo) for one communicator."""

    def __init__(self, cpu_group: Any, timeout_s: float) -> None:
        self.group = cpu_group
        self.rank = dist.get_rank(cpu_group)
        self.world = dist.get_world_size(cpu_group)
        self.timeout_s = timeout_s
        self._peers = [p for p in range(self.world) if p != self.rank]

    def gather_bytes(self, data: bytes, step: str) -> list[bytes]:
        """Every rank's ``data``, in rank order; raises naming the ranks that did not arrive."""
        deadline = self._deadline()
        lengths = {p: torch.zeros(1, dtype=torch.int64) for p in self._peers}
        self._exchange(
            torch.tensor([len(data)], dtype=torch.int64), lengths, "length", deadline, step
        )
        bufs = {p: torch.empty(int(lengths[p].item()), dtype=torch.uint8) for p in self._peers}
        if data or any(b.numel() for b in bufs.values()):
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            self._exchange(
                payload, {p: b for p, b in bufs.items() if b.numel()}, "data", deadline, step
            )
        return [data if p == self.rank else bytes(bufs[p].tolist()) for p in range(self.world)]

    def gather(self, obj: Any, step: str) -> list[Any]:
        """Every rank's JSON-serialisable ``obj``, in rank order."""
        raw = self.gather_bytes(json.dumps(obj, sort_keys=True).encode(), step)
        return [json.loads(r.decode()) for r in raw]

    def barrier(self, step: str) -> None:
        self.gather_bytes(b"", step)

    def farewell(self, epoch: int, failed: bool) -> None:
        """The barrier of destroy(): no peer may still use a workspace when it is freed.

        Every rank sends its peers ``(epoch, failed)``, ``epoch`` being the communicator's
        agreed id. A rank that knows a peer failed (``failed``) waits for nothing: its sends
        stay alive and are delivered whenever a peer receives. The others wait for every
        peer's farewell (skipping stale ones of an earlier communicator on the same group),
        and do not wait for a failed peer to take theirs."""
        mine = torch.tensor([epoch, int(failed)], dtype=torch.int64)
        if failed:
            for p in self._peers:
                try:
                    _never_taken.append(
                        dist.isend(mine, self._global(p), self.group, _TAGS["leave"])
                    )
                except RuntimeError:  # that peer died; nothing is owed to it
                    pass
            return
        bufs = {p: torch.zeros(2, dtype=torch.int64) for p in self._peers}
        self._exchange(
            mine,
            bufs,
            "leave",
            self._deadline(),
            "destroy",
            until=lambda got: int(got[0]) == epoch,
            takes_ours=lambda p: int(bufs[p][1]) == 0,
        )

    def _deadline(self) -> float | None:
        return None if self.timeout_s == 0 else time.monotonic() + self.timeout_s

    def _exchange(
        self,
        payload: torch.Tensor | None,
        into: dict[int, torch.Tensor],
        kind: str,
        deadline: float | None,
        step: str,
        until: Callable[[torch.Tensor], bool] | None = None,
        takes_ours: Callable[[int], bool] | None = None,
    ) -> None:
        """Sends ``payload`` to every peer and receives each ``into[peer]`` (repeated until
        ``until(buffer)`` holds), until all are done or the deadline passed; then waits for
        each peer to take our message, unless ``takes_ours(peer)`` says it never will.

        gloo completes a send or receive only inside wait(), a send only once the peer takes
        it, a wait that times out closes the connection, and a send dropped before it was
        taken blocks that pair's later messages. So each peer's waits run without a timeout on
        a daemon thread of their own while this thread keeps the deadline, and a send nobody
        will take is kept alive for the life of the process (a few bytes per failure)."""
        sends: dict[int, Any] = {}
        if payload is not None:
            for p in self._peers:
                try:
                    sends[p] = dist.isend(payload, self._global(p), self.group, _TAGS[kind])
                except RuntimeError as error:  # gloo: the connection to a dead peer is closed
                    raise self._error([p], step, f"its connection is closed ({error})") from error

        def run(peer: int) -> None:
            if peer in into:
                while True:
                    _WAITS.wait(dist.irecv(into[peer], self._global(peer), self.group, _TAGS[kind]))
                    if until is None or until(into[peer]):
                        break
            if peer in sends:
                if takes_ours is None or takes_ours(peer):
                    _WAITS.wait(sends[peer])
                else:
                    _never_taken.append(sends[peer])

        self._await([p for p in self._peers if p in into or p in sends], run, deadline, step)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer)

    def _await(
        self, peers: list[int], run: Callable[[int], None], deadline: float | None, step: str
    ) -> None:
        done: dict[int, BaseException | None] = {}
        changed = threading.Condition()

        def guarded(peer: int) -> None:
            try:
                run(peer)
                outcome: BaseException | None = None
            except BaseException as error:  # reported by the waiting thread
                outcome = error
            with changed:
                done[peer] = outcome
                changed.notify()

        for p in peers:
            _WAITS.start(
                threading.Thread(
                    target=guarded, args=(p,), daemon=True, name=f"pcie_allreduce-peer-{p}"
                )
            )
        with changed:
            while len(done) < len(peers):
                self._raise_failed(done, step)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    late = sorted(set(peers) - set(done))
                    raise self._error(late, step, f"it did not arrive within {self.timeout_s:g} s")
                changed.wait(left)
        self._raise_failed(done, step)

    def _raise_failed(self, done: dict[int, BaseException | None], step: str) -> None:
        failed = sorted(p for p, error in list(done.items()) if error is not None)
        if failed:
            raise self._error(failed, step, f"the connection failed ({done[failed[0]]})")

    def _error(self, missing: list[int], step: str, why: str) -> PcieAllReduceTimeout:
        who = "rank" + "s" * (len(missing) > 1) + " " + ", ".join(str(r) for r in missing)
        phase = "destroy()" if step == "destroy" else "construction"
        message = (
            f"pcie_allreduce {phase}: rank {self.rank} waited for {who} at '{step}', and {why}; "
            "it failed before this step (see its log), is slower than PCIE_ALLREDUCE_TIMEOUT_S, "
            "or never made this call. Re-create the process group before constructing again."
        )
        return PcieAllReduceTimeout(
            message, {"peer": missing[0], "missing": missing, "stage": step, "rank": self.rank}
        )
