"""Exceptions pcie_allreduce raises."""

from __future__ import annotations

from typing import Any


class PcieAllReduceTimeout(RuntimeError):
    """A peer never arrived (dead, hung, or on another path) or disagreed about the call.

    ``diagnostic`` holds what the executor recorded: this rank, the peer, the step, the stage,
    the block, and the generations seen and expected (or both ranks' numel and signature).
    """

    def __init__(self, message: str, diagnostic: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.diagnostic = diagnostic or {}

    @property
    def peer(self) -> int | None:
        return self.diagnostic.get("peer")


class TuneRefused(RuntimeError):
    """``tune()`` would measure nothing trustworthy here (inside another autotune pass, during
    graph capture, ``PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1``, a disabled communicator), so it
    measures nothing and says why, on every rank."""


class TuneError(RuntimeError):
    """A tune ran but could not produce a table (no tactic passed its correctness check, or
    every measurement was excluded): it never reports success for a tune that measured
    nothing."""


class TableMismatch(RuntimeError):
    """Ranks installed different tuning tables (``PcieAllReduce.install_table``): they would
    take different paths for the same call, so the backend is off on every rank."""
