#!/usr/bin/env bash
# The host-transport sweep recorded in docs/benchmarks.md: world 2 and 4, bf16 and fp32,
# 1 KiB to 1 MiB, pcie_allreduce against gloo in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=.venv/bin/pcie-allreduce
for world in 2 4; do
  for dtype in bf16 fp32; do
    "$bench" bench --transport host --world "$world" --dtype "$dtype" \
      --min-bytes 1K --max-bytes 1M "$@"
  done
done
