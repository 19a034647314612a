"""Exceptions pcie_allreduce raises."""

from __future__ import annotations

from typing import Any, Dict, Optional


class PcieAllReduceTimeout(RuntimeError):
    """A peer never arrived (dead, hung, or on another path) or disagreed about the call.

    ``diagnostic`` holds what the executor recorded: this rank, the peer, the step, the stage,
    the block, and the generations seen and expected (or both ranks' numel and signature).
    """

    def __init__(self, message: str, diagnostic: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.diagnostic = diagnostic or {}

    @property
    def peer(self) -> Optional[int]:
        return self.diagnostic.get("peer")
