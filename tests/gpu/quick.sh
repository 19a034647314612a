#!/usr/bin/env bash
# The prepared device calls: what a bare GPU machine (one H100 or H200, python3 with torch, nvcc,
# cmake, ninja, no network) runs first, from the repository root, each part within one command
# of the device tool.
#
#   OUT=/path bash tests/gpu/quick.sh [kernels]   # <= 7 minutes
#   OUT=/path bash tests/gpu/quick.sh torch       # <= 5 minutes, after kernels or alone
#
# kernels: builds the check programs for sm_90 only (-Werror demoted: PCIE_AR_WERROR=OFF, this
# build only), then runs each check in its own process under its own timeout, in the order of
# what the cost model and the protocol most need: the microbenchmarks, loopback correctness and
# latency at world 2 (with the host-memory passes: the cuda_host placement over real PCIe), the
# failure paths, worlds 8 and 4, PDL off.
# torch: builds the extension for the machine's torch (sm_90, -Werror off), then the torch-level
# checks, each its own pair of processes sharing the GPU: cuda_ipc through PcieAllReduce and the
# ops (graph capture, fused op, declines), cuda_host, the tuner, doctor.
#
# Each step appends one JSON line to $OUT/results.jsonl the moment it ends: a step that traps (a
# failure path kills its CUDA context) or times out loses only itself, and every step's log is
# $OUT/<step>.log as it was written. Exits 0 when every step that ran passed (skipped steps are
# reported, not failed), 1 otherwise.
#
# QUICK_BUDGET_S (default 420 for kernels, 300 for torch): the part's wall-clock budget; each
# step's limit is clipped to what is left, and a step with less than QUICK_MIN_STEP_S (default
# 10) left is skipped. QUICK_LIMIT_<step> overrides one step's limit (step names as in
# results.jsonl, '-' as '_'). QUICK_BIN_DIR: take pcie_gpu_check and pcie_gpu_microbench from
# there and build nothing (kernels and torch); QUICK_PYTHON: the interpreter of the torch checks
# (default python3). CI checks this script's control flow with stub programs
# (tests/python/tools/test_gpu_quick.py); the real programs run only on a device machine.
set -u -o pipefail

PART="${1:-kernels}"
case "$PART" in
  kernels) default_budget=420 ;;
  torch) default_budget=300 ;;
  *)
    echo "usage: $0 [kernels|torch]" >&2
    exit 2
    ;;
esac
BUDGET_S="${QUICK_BUDGET_S:-$default_budget}"
MIN_STEP_S="${QUICK_MIN_STEP_S:-10}"
OUT="${OUT:-build/gpu/quick}"
BUILD="${QUICK_BUILD_DIR:-build/gpu-quick}"
BIN="${QUICK_BIN_DIR:-$BUILD}"
PYTHON="${QUICK_PYTHON:-python3}"
RESULTS="$OUT/results.jsonl"
mkdir -p "$OUT"
start_s=$SECONDS
failed=0

left_s() { echo $((BUDGET_S - (SECONDS - start_s))); }

# record STEP STATUS RC SECONDS LIMIT: one JSON line (step names are plain words, no quoting).
record() {
  printf '{"part": "%s", "step": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "budget_left_s": %d}\n' \
    "$PART" "$1" "$2" "$3" "$4" "$5" "$(left_s)" >>"$RESULTS"
  echo "==== $1: $2 (rc $3, ${4} s of ${5} s; $(left_s) s of the budget left) ===="
}

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, the budget left) with its output
# in $OUT/NAME.log; records ok, failed, timeout (124/137 from timeout), signal (a trap or crash:
# rc > 128) or skipped (no budget left).
step() {
  local name="$1" limit="$2"
  shift 2
  local override="QUICK_LIMIT_${name//-/_}"
  limit="${!override:-$limit}"
  local left
  left=$(left_s)
  if ((left < MIN_STEP_S)); then
    record "$name" skipped -1 0 0
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "==== $name (limit ${limit} s) ===="
  local t0=$SECONDS rc status
  # Line-buffered (stdbuf, where there is one): a killed program's log keeps every line it
  # printed, where a file's block buffer would lose the last few kilobytes.
  local line_buffered=()
  command -v stdbuf >/dev/null && line_buffered=(stdbuf -oL -eL)
  timeout -k 5 "$limit" "${line_buffered[@]}" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) if ((rc > 128)); then status=signal; else status=failed; fi ;;
  esac
  [[ $status == ok ]] || failed=1
  record "$name" "$status" "$rc" $((SECONDS - t0)) "$limit"
  tail -n 3 "$OUT/$name.log"
}

touch "$RESULTS"  # both parts append to it: run kernels, then torch
finish() {
  echo "==== device check (quick $PART): $([[ $failed -eq 0 ]] && echo PASS || echo FAIL), $((SECONDS - start_s)) s; results in $RESULTS ===="
  exit "$failed"
}

if [[ $PART == torch ]]; then
  if [[ -z "${QUICK_BIN_DIR:-}" ]]; then
    step torch-build 200 env PCIE_AR_BUILD_DIR=build/gpu-quick-torch TORCH_CUDA_ARCH_LIST=9.0 \
      PCIE_AR_CUDA_ARCHS=90 PCIE_AR_BUILD_TESTS=OFF PCIE_AR_WERROR=OFF \
      "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -q .
  fi
  export PYTHONUNBUFFERED=1
  step torch-check 120 "$PYTHON" tests/gpu/torch_check.py
  step hostmem-check 120 "$PYTHON" tests/gpu/hostmem_check.py
  step tune-check 90 "$PYTHON" tests/gpu/tune_check.py
  step doctor 45 "$PYTHON" -m pcie_allreduce doctor --json
  finish
fi

step nvidia-smi 15 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv

if [[ -z "${QUICK_BIN_DIR:-}" ]]; then
  step build 180 bash -c "cmake -S . -B '$BUILD' -G Ninja -DPCIE_AR_WITH_TORCH=OFF \
    -DPCIE_AR_BUILD_TESTS=OFF -DPCIE_AR_CUDA_ARCHS=90 -DPCIE_AR_WERROR=OFF \
    && cmake --build '$BUILD' --target pcie_gpu_check pcie_gpu_microbench -j $(nproc)"
fi
if [[ ! -x "$BIN/pcie_gpu_check" || ! -x "$BIN/pcie_gpu_microbench" ]]; then
  echo "==== the check programs are not in $BIN: nothing else can run ===="
  record programs-missing failed 1 0 0
  failed=1
  finish
fi
check="$BIN/pcie_gpu_check"

# The cost model's constants: fences, polls, the launch floor with and without PDL, host-memory
# round trips over PCIe, the pinned-copy baseline; each also one JSON line in microbench.jsonl.
step microbench 60 env PCIE_GPU_JSONL="$OUT/microbench.jsonl" "$BIN/pcie_gpu_microbench"
# Correctness of every schedule at world 2, graph replay, and its latency tables (loopback; one
# virtual rank's workspace in host memory; every workspace in host memory). Every latency cell
# and fused decode time is also one JSON line in gpu_check.jsonl, written as it is measured.
jsonl="$OUT/gpu_check.jsonl"
step loopback-w2 90 env PCIE_GPU_JSONL="$jsonl" "$check" --world=2
# The failure paths: each ends in a trapped kernel, which kills the CUDA context.
for path in timeout mismatch ll-timeout ll-mismatch lamport-timeout lamport-mismatch; do
  step "fail-$path" 30 "$check" "--$path-test"
done
step loopback-w8 120 env PCIE_GPU_JSONL="$jsonl" "$check" --world=8
step loopback-w4 90 env PCIE_GPU_JSONL="$jsonl" "$check" --world=4
step pdl-off 60 env PCIE_ALLREDUCE_PDL=0 PCIE_GPU_JSONL="$jsonl" "$check" --quick --world=2

finish
