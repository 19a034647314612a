"""What the adapter reads from the real vLLM: every attribute path, the slot's API, the plugin
group, and the workspace sizing derived from real, resolved VllmConfigs. An upstream rename of
anything read here fails a test instead of silently reading as "not configured"."""

from __future__ import annotations

import inspect
import logging
import math
import types
from importlib import metadata

import pytest
from vllm_harness import TINY_HIDDEN, make_config, tiny_model_dir

from pcie_allreduce.integrations import vllm as vllm_adapter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("model")))


def _values(config):
    missing = []
    values = {
        key: vllm_adapter._get(config, path, missing)
        for key, path in vllm_adapter.CONFIG_PATHS.items()
    }
    return values, missing


def test_every_config_path_the_adapter_reads_exists_in_the_real_vllm_config(model_dir):
    config = make_config(model_dir, speculative_tokens=2, graphs=True, flashinfer_autotune=False)
    values, missing = _values(config)
    assert missing == []
    assert values["hidden"] == config.model_config.get_hidden_size() == TINY_HIDDEN
    assert values["num_speculative_tokens"] == 2
    assert values["max_capture_tokens"] == max(values["capture_sizes"]) > 0
    assert values["max_num_seqs"] == config.scheduler_config.max_num_seqs
    assert values["flashinfer_autotune"] is False
    assert values["ubatching"] is False
    config.parallel_config.enable_dbo = True
    assert _values(config)[0]["ubatching"] is True


def test_a_renamed_attribute_is_reported_not_read_as_unset(model_dir):
    config = make_config(model_dir)
    missing = []
    assert vllm_adapter._get(config, "compilation_config.max_capture_renamed", missing) is None
    assert missing == ["compilation_config.max_capture_renamed"]
    # An unset section (no speculative decoding) is not a rename.
    assert config.speculative_config is None
    assert _values(config)[1] == []
    # A config that lacks sections altogether names each path it could not read.
    partial = types.SimpleNamespace(
        model_config=config.model_config, scheduler_config=config.scheduler_config
    )
    settings = vllm_adapter.read_config(partial)
    assert set(settings.missing) == {
        vllm_adapter.CONFIG_PATHS[k]
        for k in (
            "max_capture_tokens",
            "capture_sizes",
            "num_speculative_tokens",
            "flashinfer_autotune",
            "ubatching",
        )
    }
    assert settings.hidden == TINY_HIDDEN
    assert settings.max_bs == config.scheduler_config.max_num_seqs


def test_the_environment_flags_and_hooks_the_adapter_uses_exist_upstream():
    import vllm.envs as envs
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import cuda_communicator
    from vllm.distributed.device_communicators.flashinfer_pcie_ipc_all_reduce import (
        FlashInferPcieIpcAllReduce,
    )

    for flag in ("VLLM_BATCH_INVARIANT", vllm_adapter.UPSTREAM_FLAG):
        assert flag in envs.environment_variables
    assert get_current_vllm_config_or_none() is None  # outside set_current_vllm_config
    # The slot vLLM dispatches to, enters around capture and destroys, by name.
    source = inspect.getsource(cuda_communicator.CudaCommunicator)
    assert f"self.{vllm_adapter.SLOT}: " in source
    assert f"{vllm_adapter.SLOT}.should_use(" in source
    assert f"{vllm_adapter.SLOT}.destroy()" in source
    assert f"{vllm_adapter.SLOT}.capture()" in inspect.getsource(ps.GroupCoordinator.graph_capture)
    # Our adapter answers every method of the class that slot is declared for, and its setup()
    # takes every keyword vLLM's warm-up passes.
    for method in ("should_use", "all_reduce", "capture", "setup", "destroy"):
        assert callable(getattr(vllm_adapter.VllmPcieAllReduce, method)), method
    theirs = inspect.signature(FlashInferPcieIpcAllReduce.setup).parameters
    ours = inspect.signature(vllm_adapter.VllmPcieAllReduce.setup).parameters
    assert set(theirs) - {"self"} <= set(ours)
    assert isinstance(vllm_adapter.VllmPcieAllReduce.initialized, property)


def test_our_entry_point_is_in_vllms_general_plugin_group():
    import vllm.plugins

    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    ours = [
        ep
        for ep in metadata.entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)
        if ep.name == "pcie_allreduce"
    ]
    assert [ep.value for ep in ours] == ["pcie_allreduce.integrations.vllm:register"]
    assert ours[0].load() is vllm_adapter.register


# ---------------------------------------------------------------------- sizing
def test_eager_sizing_is_max_num_seqs_times_the_tokens_verified_per_step(model_dir, monkeypatch):
    monkeypatch.delenv("PCIE_ALLREDUCE_MAX_NUMEL", raising=False)
    plain = make_config(model_dir, max_num_seqs=8)
    spec = make_config(model_dir, max_num_seqs=8, speculative_tokens=3)
    for config in (plain, spec):
        assert config.compilation_config.cudagraph_capture_sizes == []  # the CPU platform
        s = vllm_adapter.read_config(config)
        # vLLM's own count of the tokens each request verifies in a decode step.
        assert s.draft_tokens == config.uniform_decode_query_len
        assert s.max_bs == config.scheduler_config.max_num_seqs
        sizing = vllm_adapter.workspace_sizing(s)
        assert not sizing.guessed
        assert sizing.max_numel == (
            config.scheduler_config.max_num_seqs
            * config.uniform_decode_query_len
            * config.model_config.get_hidden_size()
        )
    assert (
        vllm_adapter.read_config(spec).draft_tokens > vllm_adapter.read_config(plain).draft_tokens
    )


def test_graph_sizing_covers_the_largest_captured_graph_which_already_counts_draft_tokens(
    model_dir, monkeypatch
):
    monkeypatch.delenv("PCIE_ALLREDUCE_MAX_NUMEL", raising=False)
    for k in (None, 3):
        config = make_config(model_dir, max_num_seqs=8, speculative_tokens=k, graphs=True)
        largest = config.compilation_config.max_cudagraph_capture_size
        assert largest == max(config.compilation_config.cudagraph_capture_sizes)
        s = vllm_adapter.read_config(config)
        q = config.uniform_decode_query_len
        assert s.draft_tokens == q and s.max_bs == math.ceil(largest / q)
        assert f"{largest} tokens" in s.batch_source
        rows = vllm_adapter.workspace_sizing(s).max_numel // config.model_config.get_hidden_size()
        # Every captured graph fits, and at most one request's tokens more than the largest.
        assert largest <= rows < largest + q


def test_explicit_max_numel_wins_over_the_config(model_dir, monkeypatch):
    config = make_config(model_dir, graphs=True)
    monkeypatch.setenv("PCIE_ALLREDUCE_MAX_NUMEL", "4096")
    sizing = vllm_adapter.workspace_sizing(vllm_adapter.read_config(config))
    assert sizing.max_numel == 4096 and "PCIE_ALLREDUCE_MAX_NUMEL=4096" in sizing.how


def test_without_a_model_or_a_config_the_size_is_an_announced_guess(monkeypatch, caplog):
    monkeypatch.delenv("PCIE_ALLREDUCE_MAX_NUMEL", raising=False)
    from pcie_allreduce import policy

    no_model = make_config(None)
    assert no_model.model_config is None
    for config, unread in (
        (no_model, "the hidden size"),
        (None, "the decode max batch and the hidden size"),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pcie_allreduce"):
            sizing = vllm_adapter.workspace_sizing(vllm_adapter.read_config(config))
        assert sizing.guessed and f"could not read {unread}" in sizing.how
        assert sizing.max_numel == policy.DEFAULT_ROWS * policy.DEFAULT_HIDDEN
        assert "PCIE_ALLREDUCE_MAX_NUMEL" in caplog.text


def test_the_warm_up_follows_vllms_flashinfer_autotune_switch(model_dir):
    assert (
        vllm_adapter.read_config(
            make_config(model_dir, flashinfer_autotune=False)
        ).autotune_disabled
        is True
    )
    on = make_config(model_dir, flashinfer_autotune=True)
    assert on.kernel_config.enable_flashinfer_autotune is True
    assert vllm_adapter.read_config(on).autotune_disabled is False
