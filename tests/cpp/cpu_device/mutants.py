#!/usr/bin/env python3
"""Deliberate mutations of the CUDA executor, each run on the CPU device against its suites.

Every mutant is one small edit that breaks a rule the protocol depends on. It is compiled into
the CPU device's executor through the PCIE_AR_CPU_DEVICE_OVERLAY build option (a directory of
headers searched before csrc/; the tree itself is never touched) and the CPU-device suites run
against it. A mutant is killed when a test fails (or the run hangs past its limit); a mutant that
survives is a hole in the suites, and this script exits 1.

    python3 tests/cpp/cpu_device/mutants.py            # every mutant
    python3 tests/cpp/cpu_device/mutants.py wrong_parity missing_release

Builds in build/mutants (torch and CUDA off); each mutant recompiles one translation unit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "build" / "mutants"
EXECUTOR = "transport/executors/cuda/executor.cuh"
EPILOGUE = "transport/executors/cuda/epilogue.cuh"  # the executor's fused epilogue
CPU_PRIMITIVES = "transport/executors/cuda/cpu/primitives.h"
QUANT = "plan/quant.h"  # shadowed in the CPU device's executor only: the host's stays right
# Run in turn against each mutant, each stopping at its first failure, and no further suite once
# one has failed: the matrix of tactics, then the rest (back to back across the tag wrap, the host
# cross-check, ranks as processes, the failure paths). A mutant is killed when either fails.
SUITES = (
    "Loopback/CpuDeviceExecutor.*",
    "CpuDeviceBackToBack.*:CpuDeviceCrossCheck.*:CpuDeviceProcesses.*:Paths/CpuDeviceFailure.*:"
    "CpuDeviceSignedZeros.*:CpuDeviceSplitSums.*:Fused/CpuDeviceEpilogue.*:"
    "CpuDeviceEpilogueOrder.*:CpuDeviceRounds.*",
)
# What an epilogue or quantisation mutant meets first (the fused forms' matrix, the epilogue's
# order, the fused rounds): the tactic matrix never runs the epilogue, and passing it first cost
# such a mutant half a minute. SUITES still run after it when it passes.
EPILOGUE_SUITE = "Fused/CpuDeviceEpilogue.*:CpuDeviceEpilogueOrder.*:CpuDeviceRounds.Fused*"
LIMIT_S = 900


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # under csrc/
    before: str
    after: str
    breaks: str


MUTANTS = [
    Mutant(
        "no_barrier_before_signal",
        EXECUTOR,
        "        const int n = run_length(program, s);\n        __syncthreads();\n"
        "        for (int j = thread_index(); j < n; j += blockDim.x) raise_flag(",
        "        const int n = run_length(program, s);\n"
        "        for (int j = thread_index(); j < n; j += blockDim.x) raise_flag(",
        "a signal may go out before the CTA's other threads have written their part",
    ),
    Mutant(
        "no_barrier_after_waits",
        EXECUTOR,
        "          wait_flag(p, c, s + j, program.steps[s + j]);\n        }\n"
        "        __syncthreads();\n",
        "          wait_flag(p, c, s + j, program.steps[s + j]);\n        }\n",
        "a thread may read data whose flag another thread of its CTA is still waiting for",
    ),
    Mutant(
        "no_ll_reset",
        EXECUTOR,
        "      reset_ll(ll);\n      if constexpr (!Dense) reset_ll(ll + 1);\n",
        "      if constexpr (Dense) reset_ll(ll);\n",
        "a consumed LL word keeps its tag: two calls later it names the wrong call",
    ),
    Mutant(
        "no_lamport_reset",
        EXECUTOR,
        "      reset_ll(ll);\n      if constexpr (!Dense) reset_ll(ll + 1);\n",
        "      if constexpr (!Dense) {\n        reset_ll(ll);\n        reset_ll(ll + 1);\n"
        "      }\n",
        "a consumed lamport word stays non-empty: two calls later it is taken for new data",
    ),
    Mutant(
        "first_look_trusts_tags",
        EXECUTOR,
        "      if (Dense ? !dense_arrived(lo[k]) : !ll_tags_are(lo[k], hi[k], tag)) pending |= "
        "1u << k;\n",
        "      if (Dense && !dense_arrived(lo[k])) pending |= 1u << k;\n      (void)tag;\n",
        "the first look takes an LL vector whose tags are not yet this call's: stale or "
        "half-written data is summed",
    ),
    Mutant(
        "first_look_trusts_lamport",
        EXECUTOR,
        "      if (Dense ? !dense_arrived(lo[k]) : !ll_tags_are(lo[k], hi[k], tag)) pending |= "
        "1u << k;\n",
        "      if (!Dense && !ll_tags_are(lo[k], hi[k], tag)) pending |= 1u << k;\n",
        "the first look takes a lamport vector that still holds empty words: the empty "
        "pattern is summed as data",
    ),
    Mutant(
        "decode_look_trusts_tags",
        EXECUTOR,
        "      const bool missing = Dense ? !dense_arrived(lo[k]) : "
        "!ll_tags_are(lo[k], hi[k], tag);\n",
        "      const bool missing = Dense && !dense_arrived(lo[k]);\n      (void)tag;\n",
        "the decode-shaped kernels' one look takes an LL vector whose tags are not yet this "
        "call's: stale or half-written data is summed",
    ),
    Mutant(
        "decode_look_trusts_lamport",
        EXECUTOR,
        "      const bool missing = Dense ? !dense_arrived(lo[k]) : "
        "!ll_tags_are(lo[k], hi[k], tag);\n",
        "      const bool missing = !Dense && !ll_tags_are(lo[k], hi[k], tag);\n",
        "the decode-shaped kernels' one look takes a lamport vector that still holds empty "
        "words: the empty pattern is summed as data",
    ),
    Mutant(
        "decode_plain_operand_as_ll",
        EXECUTOR,
        "      x[k] = Dense || !ll ? lo[k] : ll_payload(lo[k], hi[k]);\n",
        "      x[k] = Dense ? lo[k] : ll_payload(lo[k], hi[k]);\n",
        "the decode-shaped kernels read a plain operand (loaded twice, at +0) as LL words: half "
        "its payload is taken for tags",
    ),
    Mutant(
        "decode_second_ll_vector_at_first",
        EXECUTOR,
        "      hi[k] = Dense ? lo[k] : load_ll(at[k] + ll);\n",
        "      hi[k] = Dense ? lo[k] : load_ll(at[k]);\n",
        "the decode-shaped kernels load an LL operand's first LL vector twice: its tags pass and "
        "half its payload is the other half's",
    ),
    Mutant(
        "decode_relook_once",
        EXECUTOR,
        "      } while (pending != 0);\n",
        "      } while (false);\n",
        "the decode-shaped kernels look again only once after a miss: an operand still missing "
        "then is summed from the words its first look saw",
    ),
    Mutant(
        "decode_relook_ignores_foreign_tags",
        EXECUTOR,
        "    if (try_load_ll(at, c.ll_tag, payload, seen)) return;\n"
        "    if (plan::ll_foreign(seen, c.ll_tag)) {\n",
        "    if (try_load_ll(at, c.ll_tag, payload, seen)) return;\n    if (false) {\n",
        "the decode-shaped kernels wait out a peer that entered the generation with another call "
        "and report a timeout, not the mismatch",
    ),
    Mutant(
        "lamport_keeps_negative_zero",
        EXECUTOR,
        "  return make_uint4(plan::ll_dense_word(v.x, kBytes), plan::ll_dense_word(v.y, kBytes),\n"
        "                    plan::ll_dense_word(v.z, kBytes), "
        "plan::ll_dense_word(v.w, kBytes));\n",
        "  (void)kBytes;\n  return v;\n",
        "a lamport writer stores -0 as it is: a word that is the empty pattern never arrives",
    ),
    Mutant(
        "lamport_without_headers",
        EXECUTOR,
        "      exchange_headers(p, c, step_index, step);\n",
        "      (void)0;\n",
        "no lamport header: a peer in another call (same generation, other dtype or size) is "
        "summed instead of reported",
    ),
    Mutant(
        "fanout_first_destination_only",
        EXECUTOR,
        "    for (int j = 0; j < N; ++j) {\n"
        "      const plan::BufRef& ref = program.steps[s + j].dst;",
        "    for (int j = 0; j < 1; ++j) {\n"
        "      const plan::BufRef& ref = program.steps[s + j].dst;",
        "a fan-out loads once and stores to its first destination only: the other peers never "
        "get the data",
    ),
    Mutant(
        "fanout_joins_any_copy",
        EXECUTOR,
        "         plan::continues_fanout(first, program.steps[end])) {",
        "         plan::is_fanout_copy(program.steps[end])) {",
        "copies of different chunks run as one fan-out: every destination gets the first "
        "step's chunk",
    ),
    Mutant(
        "fanout_without_headers",
        EXECUTOR,
        "      for (int j = 0; j < N; ++j) exchange_headers(p, c, s + j, program.steps[s + j]);\n",
        "      (void)0;\n",
        "a lamport fan-out sends no headers: its readers never learn which call the data is of",
    ),
    Mutant(
        "epilogue_without_barrier",
        EXECUTOR,
        "  meet_rank_ctas(p, c, s, program.steps[s]);\n",
        "  (void)s;\n  (void)program;\n",
        "the epilogue reads whole rows before the rank's other CTAs have summed their slices",
    ),
    Mutant(
        "epilogue_barrier_does_not_wait",
        EXECUTOR,
        "    while (!plan::gen_reached(seen, c.gen)) {\n",
        "    while (false) {\n",
        "the rank's CTAs announce their slices done but do not wait for each other",
    ),
    Mutant(
        "epilogue_fuses_multiply_add",
        EPILOGUE,
        "        for (int e = 0; e < kElems; ++e) acc[e] = add_rn(acc[e], mul_rn(a[e], a[e]));\n",
        "        for (int e = 0; e < kElems; ++e) acc[e] = std::fma(a[e], a[e], acc[e]);\n",
        "the mean of squares contracts into FMAs: the bits differ from the host's (and from "
        "plan/epilogue.h's order)",
    ),
    Mutant(
        "epilogue_partials_transposed",
        EPILOGUE,
        "      for (int e = 0; e < kElems; ++e) partials[j * kElems + e] = acc[e];\n",
        "      for (int e = 0; e < kElems; ++e) partials[e * kPositions + j] = acc[e];\n",
        "the partials enter the tree in another order: a row's norm depends on the layout",
    ),
    Mutant(
        "epilogue_weight_offset_ignored",
        EPILOGUE,
        "  const float addend = plan::weight_addend(p.weight_offset);\n",
        "  const float addend = -0.0f;\n",
        "the weight offset is never added: a Gemma layer (offset 1) normalises with w, not w + 1",
    ),
    Mutant(
        "epilogue_y_lands_in_output",
        EPILOGUE,
        "  uint4* y = static_cast<uint4*>(tensors.y);\n",
        "  uint4* y = static_cast<uint4*>(tensors.y != nullptr ? tensors.y : p.outputs[rank]);\n",
        "a call that asked for y_q alone gets y stored over its output (the sum, or residual_out "
        "without a residual)",
    ),
    Mutant(
        "fp8_scale_applied_twice",
        EPILOGUE,
        "              const float scaled = mul_rn(a[4 * i + k], inv_scale);\n",
        "              const float scaled = mul_rn(mul_rn(a[4 * i + k], inv_scale), inv_scale);\n",
        "y is divided by the scale twice before it is quantised",
    ),
    Mutant(
        "fp8_quantises_unrounded_y",
        EPILOGUE,
        "          M::widen(y_vec, a);  // the y stored: rounded to the dtype, then widened "
        "(exact)\n",
        "          (void)y_vec;  // a: y in fp32, not rounded to the dtype\n",
        "the fp8 output quantises the fp32 y, not y rounded to the dtype as vLLM's kernels do: "
        "bf16 and fp16 codes differ near the midpoints",
    ),
    Mutant(
        "nvfp4_nibbles_swapped",
        EPILOGUE,
        "          codes[i] |= code << (4 * e);\n",
        "          codes[i] |= code << (4 * (e ^ 1));\n",
        "NVFP4's even element goes to the high nibble of its byte: every code pair is swapped",
    ),
    Mutant(
        "nvfp4_scale_layout_transposed",
        EPILOGUE,
        "  return q.block_scale + plan::nvfp4_scale_offset(row, 4 * g, q.k_tiles);\n",
        "  return q.block_scale + ((row / 128) * q.k_tiles + g) * 512 + ((row / 32) % 4) * 128 +\n"
        "         (row % 32) * 4;\n",
        "the 128-row scale tile is laid out [4][32] rows instead of vLLM's [32][4] (r % 32 and "
        "(r / 32) % 4 swapped): the GEMM reads another row's block scales",
    ),
    Mutant(
        "fp8_rounds_toward_zero",
        QUANT,
        "  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;\n",
        "  const uint32_t rounded = a >> 20;\n",
        "normal e4m3 codes truncate instead of rounding to nearest even",
    ),
    Mutant(
        "fp8_subnormal_threshold_low",
        QUANT,
        "  const uint32_t code = a >= 0x3c800000u ? normal : subnormal;  // 2^-6\n",
        "  const uint32_t code = a >= 0x3c000000u ? normal : subnormal;  // 2^-6\n",
        "values in [2^-7, 2^-6) take the normal e4m3 rounding instead of the subnormal step: "
        "their codes are garbage",
    ),
    Mutant(
        "split_ignored",
        EXECUTOR,
        "uint32_t split_of(const plan::Step& step) { return step.split; }\n",
        "uint32_t split_of(const plan::Step& step) {\n  (void)step;\n  return 0;\n}\n",
        "a split step is summed as one sum: a flat tactic on two islands rounds once where the "
        "island tactics round the partials first, and the group's tactics disagree in the last bit",
    ),
    Mutant(
        "chunk_stride_ignored",
        EXECUTOR,
        "  return plan::chunk_shift(c.num_vecs, program.num_chunks, step.chunk, "
        "p.chunk_stride_vecs);\n",
        "  (void)p;\n  (void)c;\n  (void)program;\n  (void)step;\n  return 0;\n",
        "a streamed reduce-scatter's or all-gather's round addresses its chunks where its own "
        "message puts them, not chunk_stride apart: it reads and writes the wrong elements of "
        "the tensors",
    ),
    Mutant(
        "no_positive_zero_start",
        EXECUTOR,
        "inline constexpr float kSumStart = 0.0f;\n",
        "inline constexpr float kSumStart = -0.0f;\n",
        "sums start at their first operand (-0 + x is x): zeros that are all -0 sum to -0 in flag "
        "and LL but to +0 in lamport, whose writers store -0 as +0",
    ),
    Mutant(
        "wrong_parity",
        EXECUTOR,
        "  c.parity = plan::gen_parity(c.gen);\n",
        "  c.parity = 0;\n",
        "no double buffer: a fast rank overwrites what a slow peer still reads",
    ),
    Mutant(
        "missing_release",
        CPU_PRIMITIVES,
        "  cpu_device::store_release(ptr, &gen, sizeof(gen));\n",
        "  cpu_device::store(ptr, &gen, sizeof(gen));\n",
        "a flag's generation is a plain store: it may land before the data it announces",
    ),
    Mutant(
        "call_after_release",
        CPU_PRIMITIVES,
        "  cpu_device::store(static_cast<uint64_t*>(ptr) + 1, &call, sizeof(call));\n"
        "  cpu_device::store_release(ptr, &gen, sizeof(gen));\n",
        "  cpu_device::store_release(ptr, &gen, sizeof(gen));\n"
        "  cpu_device::store(static_cast<uint64_t*>(ptr) + 1, &call, sizeof(call));\n",
        "a reader that acquired the generation may see the previous call's identity (the "
        "torn flag the CPU device found)",
    ),
]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, **kw)


def overlay(m: Mutant) -> Path:
    """A directory holding only the mutated file, at its path under csrc/."""
    src = (ROOT / "csrc" / m.path).read_text()
    count = src.count(m.before)
    if count != 1:
        sys.exit(
            f"mutant {m.name}: the text to mutate occurs {count} times in csrc/{m.path} "
            "(expected once): update the mutant with the code"
        )
    where = BUILD / "overlays" / m.name
    shutil.rmtree(where, ignore_errors=True)
    target = where / m.path
    target.parent.mkdir(parents=True)
    target.write_text(src.replace(m.before, m.after))
    return where


def build(overlay_dir: Path | str) -> None:
    configure = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(BUILD),
        "-DPCIE_AR_WITH_TORCH=OFF",
        "-DPCIE_AR_WITH_CUDA=OFF",
        f"-DPCIE_AR_CPU_DEVICE_OVERLAY={overlay_dir}",
    ]
    if shutil.which("ninja") and not (BUILD / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    for cmd in (
        configure,
        [
            "cmake",
            "--build",
            str(BUILD),
            "-j",
            os.environ.get("JOBS", "2"),
            "--target",
            "pcie_cpu_device_tests",
        ],
    ):
        done = run(cmd)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")


def suites(order: tuple[str, ...] = SUITES) -> tuple[str, list[str], float]:
    """('passed'|'failed'|'hung', the first failing test, seconds): the suites in `order`, up to
    the first that fails or hangs (a mutant is killed by one; the others would add only time)."""
    start = time.monotonic()
    outcome, failed = "passed", []
    for suite in order:
        if outcome != "passed":
            break
        try:
            done = run(
                [
                    str(BUILD / "pcie_cpu_device_tests"),
                    f"--gtest_filter={suite}",
                    "--gtest_fail_fast",
                ],
                timeout=LIMIT_S,
            )
        except subprocess.TimeoutExpired:
            outcome = "hung"
            continue
        failed += sorted(set(re.findall(r"^\[  FAILED  \] ([^\s,]+\.[^\s,]+)", done.stdout, re.M)))
        if done.returncode != 0 and outcome == "passed":
            outcome = "failed"
    return outcome, failed, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        sys.exit(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.names] or MUTANTS
    BUILD.mkdir(parents=True, exist_ok=True)
    survivors = []
    for m in chosen:
        build(overlay(m))
        first = (EPILOGUE_SUITE,) if m.path in (EPILOGUE, QUANT) else ()
        outcome, failed, seconds = suites((*first, *SUITES))
        caught = (
            ", ".join(failed) if failed else ("(hung past the limit)" if outcome == "hung" else "-")
        )
        verdict = "SURVIVED" if outcome == "passed" else "killed"
        print(
            f"{m.name:26} {verdict:8} {seconds:6.1f} s  breaks: {m.breaks}\n"
            f"{'':26} caught by {caught}",
            flush=True,
        )
        if outcome == "passed":
            survivors.append(m.name)
    build("")  # leave the build directory with the real executor
    outcome, failed, _ = suites()
    if outcome != "passed":
        print(f"the unmutated executor fails the suites: {', '.join(failed) or outcome}")
        return 1
    if survivors:
        print(f"surviving mutants: {', '.join(survivors)}")
        return 1
    print(f"all {len(chosen)} mutants killed; the unmutated executor passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
