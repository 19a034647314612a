"""Every SGLang path, name and call shape the integration relies on, checked against the
installed SGLang source (line numbers drift; these do not)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pkgutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

import pcie_allreduce.integrations.sglang as ours  # noqa: E402
import pcie_allreduce.integrations.sglang_config as sglang_config  # noqa: E402

SLOT = ours.SglangPcieAllReduce


def _source(module: str) -> ast.Module:
    """A module's syntax tree, without importing it or its packages (the runner's need
    transformers, which the CPU recipe does not install)."""
    root = Path(importlib.util.find_spec("sglang").origin).parent
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text())


def _slot_uses(tree: ast.Module) -> dict:
    """{attribute: [keyword names of each call]} for every `<x>.pcie_ipc_comm.<attribute>`."""
    uses: dict = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "pcie_ipc_comm"
        ):
            uses.setdefault(node.attr, [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "pcie_ipc_comm") or (
                isinstance(owner, ast.Name) and owner.id == "pcie_ipc_comm"
            ):
                uses.setdefault(node.func.attr, []).append(
                    (len(node.args), sorted(k.arg for k in node.keywords))
                )
    return uses


def test_the_entry_point_sglang_loads_is_our_zero_argument_register():
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "pcie_allreduce"]
    assert [ep.value for ep in found] == ["pcie_allreduce.integrations.sglang:register"]
    register = found[0].load()
    assert register is ours.register
    assert not [
        p for p in inspect.signature(register).parameters.values() if p.default is p.empty
    ]  # load_plugins() calls func()


def test_the_hook_target_resolves_to_group_coordinator_init_with_a_group_name():
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    owner, _, attr = ours.HOOK_TARGET.rpartition(".")
    assert pkgutil.resolve_name(owner) is GroupCoordinator and attr == "__init__"
    assert "group_name" in inspect.signature(GroupCoordinator.__init__).parameters
    assert HookType.AFTER.value == "after" and callable(HookRegistry.register)
    # Our hook reads these attributes of the coordinator SGLang has just built.
    tree = _source("sglang.srt.distributed.parallel_state")
    assigned = {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert {
        "unique_name",
        "world_size",
        "rank_in_group",
        "device",
        "device_group",
        "cpu_group",
        "pcie_ipc_comm",
    } <= assigned


def test_every_slot_member_sglang_uses_exists_with_the_call_shape_sglang_uses():
    uses = _slot_uses(_source("sglang.srt.distributed.parallel_state"))
    runner = _slot_uses(_source("sglang.srt.model_executor.runner.base_runner"))
    assert {"disabled", "should_pcie_ipc_ar", "pcie_ipc_all_reduce", "destroy"} <= set(uses)
    assert runner["prepare"] == [(0, ["hidden", "max_rows"])]
    for name, calls in {**uses, **runner}.items():
        assert hasattr(SLOT, name), name
        for positional, keywords in calls:
            params = inspect.signature(getattr(SLOT, name)).parameters
            assert len([p for p in params.values() if p.name != "self"]) >= positional
            assert set(keywords) <= set(params), (name, keywords)
    assert isinstance(inspect.getattr_static(SLOT, "disabled"), property)
    # The slot mirrors SGLang's own communicator's public API.
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import PcieIpcCommunicator

    theirs = {n for n in vars(PcieIpcCommunicator) if not n.startswith("_")}
    assert theirs <= {n for n in dir(SLOT) if not n.startswith("_")}


def test_sglang_dispatches_to_the_slot_after_the_custom_all_reduce():
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    order = inspect.getsource(GroupCoordinator._resolve_outplace_all_reduce_method)
    # The custom all-reduce (NVLink hosts) is asked first: the CPU tests have none to show it.
    assert (
        order.index('return "ca"')
        < order.index('return "pcie_ipc"')
        < order.index('return "pynccl"')
    )


def test_the_config_paths_we_read_are_sglangs_namespaces():
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.server_args import ServerArgs

    namespaces = namespace_of(ServerArgs)
    # get_exec().graph.cuda_graph_config, get_spec().speculative_*,
    # get_exec().deterministic.enable_deterministic_inference,
    # get_exec().kernel.disable_flashinfer_autotune
    assert {
        f: namespaces[f]
        for f in (
            "cuda_graph_config",
            "speculative_algorithm",
            "speculative_num_draft_tokens",
            "enable_deterministic_inference",
            "disable_flashinfer_autotune",
        )
    } == {
        "cuda_graph_config": "exec.graph",
        "speculative_algorithm": "spec",
        "speculative_num_draft_tokens": "spec",
        "enable_deterministic_inference": "exec.deterministic",
        "disable_flashinfer_autotune": "exec.kernel",
    }
    assert isinstance(CudaGraphConfig().decode, PhaseConfig)
    assert "max_bs" in {f.name for f in PhaseConfig.__dataclass_fields__.values()}
    # SGLang's runtime context adds the launch-time draft capacity next to the active width.
    from sglang.srt import runtime_context

    assert '"max_speculative_num_draft_tokens"' in inspect.getsource(
        runtime_context.RuntimeContext.set_server_args
    )


def test_the_accessors_raise_value_error_until_server_args_are_published():
    from sglang.srt.runtime_context import get_context, get_exec, get_spec

    if get_context().is_config_namespace_published("exec"):
        pytest.skip("this process published server args")
    for accessor in (get_exec, get_spec):
        with pytest.raises(ValueError):
            accessor()
    max_bs, draft, why = sglang_config.decode_width()
    assert (max_bs, draft) == (None, None) and "not published" in why
    assert sglang_config.engine_autotune_disabled() is False


def test_the_deterministic_rule_and_the_flags_are_sglangs():
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.environ import envs

    rule = inspect.getattr_static(GroupCoordinator, "_deterministic_collectives_enabled")
    assert isinstance(rule, staticmethod)
    for flag in (
        "SGLANG_USE_1STAGE_ALLREDUCE",
        "SGLANG_ENABLE_DETERMINISTIC_INFERENCE",
        ours.UPSTREAM_FLAG,
    ):
        assert hasattr(envs, flag), flag
    # The upstream slot is only ever built for the group named exactly "tp".
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    assert pcie_ipc_ar._ELIGIBLE_GROUP_NAMES == frozenset({"tp"})


def test_a_config_path_this_sglang_lacks_is_said_not_silently_guessed(monkeypatch, caplog):
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace())
    max_bs, draft, why = sglang_config.decode_width()
    assert (max_bs, draft) == (None, None)
    assert why == "SGLang's config has no get_exec().graph.cuda_graph_config"
    assert "cannot read SGLang's get_exec().graph.cuda_graph_config" in caplog.text
