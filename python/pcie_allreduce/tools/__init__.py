"""The tools, apart from the runtime: ``bench/``, ``tune`` and ``topo`` (with ``ranks``, what the
rank-spawning commands share) and ``doctor/``. ``pcie_allreduce.cli`` is their command line; the
runtime (``PcieAllReduce`` and what it is built from) never imports them."""
