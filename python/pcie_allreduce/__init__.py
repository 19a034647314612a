"""pcie_allreduce: decode-sized all-reduce for tensor-parallel inference on PCIe-only hosts.

Construct :class:`PcieAllReduce` for the tensor-parallel group; it takes the reductions its
kernels win and hands everything else to the group's own all-reduce (NCCL or gloo).
"""

from __future__ import annotations

import torch

from . import _C  # registers torch.ops.pcie_allreduce.*
from . import plan
from .communicator import PcieAllReduce
from .errors import PcieAllReduceTimeout

__version__ = "0.1.0"
__all__ = ["PcieAllReduce", "PcieAllReduceTimeout", "plan", "__version__"]


@torch.library.register_fake("pcie_allreduce::all_reduce")
def _all_reduce_fake(inp: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)


@torch.library.register_fake("pcie_allreduce::all_reduce_")
def _all_reduce_inplace_fake(inp: torch.Tensor, handle: int) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_reduce_into")
def _all_reduce_into_fake(inp: torch.Tensor, handle: int, out: torch.Tensor) -> None:
    return None
