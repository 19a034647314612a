"""Real vLLM (0.33.0) on the CPU: every rank is its own spawned process that builds vLLM's real
groups over gloo the way vLLM's worker does, with the platform's device communicator pointed at
vLLM's real CudaCommunicator, so vLLM's own dispatch, graph_capture() and destroy reach the slot
our plugin fills. pcie_allreduce's host transport runs over real POSIX shared memory.

A module of its own (not conftest) so that spawned ranks import it by a name no other test
folder uses."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared spawner
from spawned_ranks import LogRecords, fail_on_errors, report, spawn_ranks  # noqa: E402

SHM_PREFIX = "pcie_ar."
CUDA_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"
TINY_ARCH = "PcieArTinyForCausalLM"
TINY_HIDDEN = 256

# What every rank (and this process, for the config tests) runs vLLM with on a CPU-only host.
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_DISABLE_PYNCCL": "1",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
# Our defaults in every rank unless a test says otherwise: the kernels on for the integration,
# no 60 s warm-up tune (one test turns it back on with a small budget).
OUR_ENV = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
# Unset in the test session unless a test sets them.
FLAGS_UNDER_TEST = (
    "PCIE_ALLREDUCE_ENABLE",
    "PCIE_ALLREDUCE_DISABLE_AUTOTUNE",
    "PCIE_ALLREDUCE_MAX_NUMEL",
    "PCIE_ALLREDUCE_TABLE",
    "VLLM_BATCH_INVARIANT",
    "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC",
    "VLLM_PLUGINS",
)

SPAWNED_PIDS: list[int] = []  # every rank process run_ranks started in this session


def shm_entries() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIX)}


def creator_pid(name: str) -> int:
    """The pid in a segment name "pcie_ar.<pid>.<...>" (0 when there is none)."""
    field = name[len(SHM_PREFIX) :].split(".", 1)[0]
    return int(field) if field.isdigit() else 0


def leaked_since(before: set[str], first: int) -> set[str]:
    """Segments created by the ranks spawned since SPAWNED_PIDS had `first` entries and still
    in /dev/shm (other processes on a shared machine may come and go meanwhile)."""
    ours = set(SPAWNED_PIDS[first:])
    return {n for n in shm_entries() - before if creator_pid(n) in ours}


# ---------------------------------------------------------------------- a tiny "model"
def tiny_model_dir(root: str) -> str:
    """A local config.json for a registered stand-in architecture: vLLM's real ModelConfig
    reads it (hidden size TINY_HIDDEN) without a hub or vLLM's compiled model code."""
    path = Path(root) / "tiny-model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": [TINY_ARCH],
                "model_type": "llama",
                "hidden_size": TINY_HIDDEN,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 1024,
                "max_position_embeddings": 512,
                "torch_dtype": "bfloat16",
                "rms_norm_eps": 1e-5,
            }
        )
    )
    return str(path)


def register_tiny_model() -> None:
    import torch
    from vllm import ModelRegistry

    class PcieArTinyForCausalLM(torch.nn.Module):
        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            return input_ids

        def forward(self, input_ids: Any, positions: Any) -> Any:
            return input_ids

        def compute_logits(self, hidden_states: Any) -> Any:
            return hidden_states

    if TINY_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TINY_ARCH, PcieArTinyForCausalLM)


def make_config(
    model_dir: str | None = None,
    *,
    max_num_seqs: int = 8,
    speculative_tokens: int | None = None,
    graphs: bool = False,
    flashinfer_autotune: bool | None = None,
) -> Any:
    """A real, resolved VllmConfig. Without ``model_dir``: VllmConfig() (no model). ``graphs``:
    re-runs vLLM's own capture-size derivation as the CUDA platform would (the CPU platform
    turns CUDA graphs off)."""
    from vllm.config import (
        CUDAGraphMode,
        KernelConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    if model_dir is None:
        return VllmConfig()
    register_tiny_model()
    kwargs: dict[str, Any] = {}
    if speculative_tokens:
        kwargs["speculative_config"] = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=1,
        )
    if flashinfer_autotune is not None:
        kwargs["kernel_config"] = KernelConfig(enable_flashinfer_autotune=flashinfer_autotune)
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        **kwargs,
    )
    if graphs:
        cc = config.compilation_config
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        cc.max_cudagraph_capture_size = None
        cc.cudagraph_capture_sizes = None
        config._set_cudagraph_sizes()
    return config


# ---------------------------------------------------------------------- vLLM's groups
def capture_logs() -> LogRecords:
    handler = LogRecords()
    ours = logging.getLogger("pcie_allreduce")
    ours.addHandler(handler)
    ours.setLevel(logging.DEBUG)
    return handler


def point_platform_at_cuda_communicator() -> None:
    """The CPU platform's CpuCommunicator has no PCIe slot; vLLM's CUDA dispatch runs on CPU
    tensors as well."""
    from vllm.platforms import current_platform

    current_platform.get_device_communicator_cls = lambda: CUDA_COMMUNICATOR


def init_vllm_groups(
    rank: int, world: int, init_file: str, *, tp: int = 2, config: Any = None, plugins: bool = True
) -> Any:
    """vLLM's worker path on the CPU: plugins, then the world and model-parallel groups inside
    set_current_vllm_config. Returns the tp GroupCoordinator."""
    if plugins:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    point_platform_at_cuda_communicator()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ps.set_custom_all_reduce(False)
    with set_current_vllm_config(config if config is not None else VllmConfig()):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"file://{init_file}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    return ps.get_tp_group()


def teardown_vllm_groups() -> None:
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def slot_of(group: Any) -> Any:
    return group.device_communicator.fi_pcie_ipc_ar_comm


class FakeStream:
    """torch.cuda's stream objects on a CPU-only host (only they are faked for capture)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def __eq__(self, other: Any) -> bool:
        return self is other

    __hash__ = object.__hash__


def fake_cuda_streams() -> None:
    import contextlib

    import torch

    current = FakeStream()
    torch.cuda.Stream = lambda *a, **k: FakeStream()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: current  # type: ignore[assignment]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]


# ---------------------------------------------------------------------- spawned ranks
def _entry(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    out_dir: str,
) -> None:
    os.environ.update(VLLM_CPU_ENV)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    report(rank, out_dir, lambda: fn(rank, world, init_file, *args))


class RankResults(list):
    def values(self) -> list[Any]:
        return [r["value"] for r in self]


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    env: dict[str, str] | None = None,
    our_env: bool = True,
    timeout: float = 420.0,
) -> RankResults:
    """Runs fn(rank, world, init_file, *args) in `world` spawned processes with the vLLM CPU
    environment (plus OUR_ENV unless `our_env` is False, then `env`). Fails the test if a
    rank hangs past `timeout` (it is killed) or raises. Returns one result dict per rank."""
    full = dict(OUR_ENV) if our_env else {}
    full.update(env or {})
    results = RankResults(
        r
        if isinstance(r, dict)
        else {"ok": False, "error": f"exit code {r}", "type": "Died", "traceback": ""}
        for r in spawn_ranks(_entry, world, fn, args, full, timeout, SPAWNED_PIDS.append)
    )
    fail_on_errors(results)
    return results
