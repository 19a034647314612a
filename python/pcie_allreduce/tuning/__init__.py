"""Tuning: this host's tuning cache (``cache``: read by every construction, written by a tune),
the tuner that measures it (``tuner``: ``PcieAllReduce.tune()``, ``pcie-allreduce tune``), the
rule that picks a bucket's winner from its timings (``decision``) and the autotune-pass marker
engines wrap their own passes in (``passes.autotune_pass``, also here)."""

from .passes import autotune_pass

__all__ = ["autotune_pass"]
