"""A tune's progress, one step per size bucket: a bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("pcie_allreduce")


class Progress:
    """A bar on a terminal, log lines otherwise (rank 0 only)."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.done, self.show = total, 0, show
        self.tty = show and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.show:
            return
        if self.tty:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[pcie_allreduce tune] [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} {what:<40}"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            logger.info("pcie_allreduce tune: %d/%d %s", self.done, self.total, what)
