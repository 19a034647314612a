#!/usr/bin/env bash
# The device check: the one script a machine with a GPU runs, from the repository root.
# Builds the check program for sm_90 (no torch, no GoogleTest), records the GPU, runs the
# loopback correctness / graph-replay / latency check (flag and LL protocols, programmatic
# dependent launch on; latency also with one virtual rank's workspace in host memory, and a
# last pass with every virtual rank's workspace in mapped host memory, the cuda_host
# transport's placement: correctness with inputs changing every call, graph replay, latency),
# the microbenchmarks (with the pinned-memory copy baseline), a quick pass with PDL off, then
# the four failure paths (each traps its kernel, which kills the CUDA context, so each runs in
# its own process), the torch-level checks (cuda_ipc, then cuda_host), a loopback tune and
# doctor. Logs go to $OUT.
# Exits non-zero if any step fails; every step runs even after an earlier failure.
#
#   bash tests/gpu/run.sh [all|kernels|torch|hostmem]
#
# The parts can run as separate commands on one machine (the builds are kept between them), so
# each fits a short time limit: `kernels` (the check programs: loopback, microbench, PDL off,
# failure paths), `torch` (the extension, torch and hostmem checks, topo, tune, doctor),
# `hostmem` (only the cuda_host transport's checks: its loopback pass, the microbenchmarks with
# the pinned-copy baseline, and the hostmem check). Default: all.
set -o pipefail
set -u

PART="${1:-all}"
case "$PART" in
  all | kernels | torch | hostmem) ;;
  *)
    echo "usage: $0 [all|kernels|torch|hostmem]" >&2
    exit 2
    ;;
esac
want() {  # want PART...: whether this run includes any of them
  local p
  for p in "$@"; do
    [[ "$PART" == all || "$PART" == "$p" ]] && return 0
  done
  return 1
}

OUT="${OUT:-build/gpu/out}"
mkdir -p "$OUT"
BUILD=build/gpu
status=0

step() {  # step NAME LOGFILE COMMAND...: runs, tees to $OUT/LOGFILE, records a failure
  local name="$1" log="$2"
  shift 2
  echo "==== $name ===="
  if "$@" 2>&1 | tee "$OUT/$log"; then
    echo "==== $name: ok ===="
  else
    echo "==== $name: FAILED (exit ${PIPESTATUS[0]}) ===="
    status=1
  fi
}

step "configure" configure.log \
  cmake -S . -B "$BUILD" -G Ninja -DPCIE_AR_WITH_TORCH=OFF -DPCIE_AR_CUDA_ARCHS=90 \
  -DPCIE_AR_BUILD_TESTS=OFF
step "build pcie_gpu_check" build.log \
  cmake --build "$BUILD" --target pcie_gpu_check pcie_gpu_microbench -j "$(nproc)"
if [[ ! -x "$BUILD/pcie_gpu_check" ]]; then
  echo "pcie_gpu_check was not built; see $OUT/build.log"
  exit 1
fi

# The torch extension builds in the background while the loopback check runs.
export TORCH_CUDA_ARCH_LIST=9.0 PCIE_AR_CUDA_ARCHS=90 PCIE_AR_BUILD_TESTS=OFF \
  PCIE_AR_BUILD_DIR=build/gpu-torch PYTHONUNBUFFERED=1
torch_build=""
if want torch hostmem; then
  (python3 -m pip install --no-build-isolation --no-deps --no-index -q . >"$OUT/torch_build.log" 2>&1;
   echo "exit $?" >>"$OUT/torch_build.log") &
  torch_build=$!
fi

step "nvidia-smi" nvidia-smi.log nvidia-smi
nvidia-smi topo -m > "$OUT/nvidia-smi-topo.log" 2>&1 || true

# Correctness for every schedule x direction x staging x dtype x size x shape, graph replay
# x1000 per tactic, latency table; then the same with every workspace in mapped host memory
# (the cuda_host placement; latency at worlds 2 and 4). `--hostmem-only` reruns just that pass.
# A protocol bug traps after 10 s instead of hanging; the outer timeout is the last resort.
if want kernels; then
  step "loopback check" gpu_check.log timeout 420 "$BUILD/pcie_gpu_check"
elif want hostmem; then
  step "loopback check, host memory only" gpu_check_hostmem.log timeout 300 \
    "$BUILD/pcie_gpu_check" --hostmem-only
fi

# What the latency model assumes, measured: a system fence after local and after host-memory
# (PCIe) writes, serial vs parallel flag polls, the graph launch floor with and without PDL;
# and the baseline cuda_host must beat: an all-reduce by pinned-memory copies and a CPU reduce
# (W = 2, 4; 1/12/96 KiB bf16), with the single D2H / H2D round trips it is made of.
if want kernels hostmem; then
  step "microbenchmarks" microbench.log timeout 60 "$BUILD/pcie_gpu_microbench"
fi

if want kernels; then
  # The plain launch path: world 2, fewer sizes, no latency tables.
  step "loopback check, PDL off" gpu_check_no_pdl.log env PCIE_ALLREDUCE_PDL=0 \
    timeout 120 "$BUILD/pcie_gpu_check" --quick --world=2

  # Rank 1 withheld: rank 0 must time out after 1 s and name peer 1 (flag, then LL data).
  step "timeout path" timeout_test.log timeout 60 "$BUILD/pcie_gpu_check" --timeout-test
  step "LL timeout path" ll_timeout_test.log timeout 60 "$BUILD/pcie_gpu_check" \
    --ll-timeout-test

  # Ranks launched with different dtypes: the flag's signature check (flag) and the tag of
  # the peer's data (LL) must catch it.
  step "mismatch path" mismatch_test.log timeout 60 "$BUILD/pcie_gpu_check" --mismatch-test
  step "LL mismatch path" ll_mismatch_test.log timeout 60 "$BUILD/pcie_gpu_check" \
    --ll-mismatch-test
  # Lamport: the same two paths through its slice headers (the data carries no tag).
  step "lamport timeout path" lamport_timeout_test.log timeout 60 "$BUILD/pcie_gpu_check" \
    --lamport-timeout-test
  step "lamport mismatch path" lamport_mismatch_test.log timeout 60 "$BUILD/pcie_gpu_check" \
    --lamport-mismatch-test
fi

if [[ -z "$torch_build" ]]; then
  echo "==== device check ($PART): $([[ $status -eq 0 ]] && echo PASS || echo FAIL) ===="
  exit "$status"
fi

# torch-level checks: the real cuda_ipc transport through PcieAllReduce and the torch ops,
# two processes sharing the GPU (IPC handles, graph capture, declines, timeout -> exception).
wait "$torch_build"
echo "==== build torch extension: $(tail -n 1 "$OUT/torch_build.log") ===="
tail -n 20 "$OUT/torch_build.log"
if want torch; then
  step "torch check" torch_check.log timeout 300 python3 tests/gpu/torch_check.py
fi
# The cuda_host transport (GPUs without P2P) through PcieAllReduce: forced (transport="hostmem")
# over every table x dtype x size, graph replay, the automatic switch after a (faked) failed P2P
# check, the timeout path, and nothing left in /dev/shm; two then four processes share the GPU
# (time-sliced: correctness and behaviour, not latency).
step "hostmem check" hostmem_check.log timeout 240 python3 tests/gpu/hostmem_check.py
if want torch; then
  step "topo" topo.log python3 -m pcie_allreduce topo
  # The tuner under graph replay in loopback (two ranks on the one GPU), and doctor's verdict.
  step "tune check" tune_check.log timeout 300 python3 tests/gpu/tune_check.py
  step "doctor" doctor.log timeout 120 python3 -m pcie_allreduce doctor --json
fi

echo "==== device check ($PART): $([[ $status -eq 0 ]] && echo PASS || echo FAIL) ===="
exit "$status"
