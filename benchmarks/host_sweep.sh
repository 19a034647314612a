#!/usr/bin/env bash
# A host-transport sweep: world 2 and 4, bf16 and fp32, 1 KiB to 1 MiB, pcie_allreduce against
# gloo in the same run. Extra arguments go to every bench (e.g. --iters 200).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=.venv/bin/pcie-allreduce
for world in 2 4; do
  for dtype in bf16 fp32; do
    "$bench" bench --transport host_shm --world "$world" --dtype "$dtype" \
      --min-bytes 1K --max-bytes 1M "$@"
  done
done
