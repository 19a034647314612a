"""pcie_allreduce: decode-sized all-reduce for tensor-parallel inference on PCIe-only hosts.

Construct :class:`PcieAllReduce` for the tensor-parallel group; it takes the reductions its
kernels win and hands everything else to the group's own all-reduce (NCCL or gloo).

Importing the package is cheap: the extension (``_C``, which registers the torch ops) and torch
load when a name that needs them is first used (``PcieAllReduce``, ``plan``, ``_C``), so an
engine plugin that stays off costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import PcieAllReduceTimeout

__version__ = "0.1.0"
__all__ = ["PcieAllReduce", "PcieAllReduceTimeout", "plan", "__version__"]


def __getattr__(name: str) -> Any:
    """The names that load the extension, loaded on first use (PEP 562). import_module, not
    ``from . import``: that form would ask this function again for the same name."""
    if name == "PcieAllReduce":
        return importlib.import_module(".communicator", __name__).PcieAllReduce
    if name == "plan":
        return importlib.import_module(".plan", __name__)
    if name == "_C":
        return importlib.import_module(".native", __name__)._C
    raise AttributeError(f"module 'pcie_allreduce' has no attribute {name!r}")
