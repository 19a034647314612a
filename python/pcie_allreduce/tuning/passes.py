"""Autotune passes: ``tune()`` refuses to run inside one, because timings taken inside another
tuner's pass (FlashInfer's, an engine's warm-up) or a graph capture measure that, not us."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_nesting = threading.local()


@contextlib.contextmanager
def autotune_pass(name: str) -> Iterator[None]:
    """Marks an autotune pass on this thread (the outermost name is kept). Engine integrations
    wrap their own passes in it; ``PcieAllReduce.capture()`` wraps a graph capture."""
    outer = current_pass()
    _nesting.name = name if outer is None else outer
    try:
        yield
    finally:
        _nesting.name = outer


def current_pass() -> str | None:
    """The autotune pass this thread is inside, or None."""
    return getattr(_nesting, "name", None)
