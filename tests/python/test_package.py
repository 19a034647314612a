"""What importing the package costs: nothing heavy until a communicator or the ops are used."""

import os
import subprocess
import sys

import pytest

_NOT_LOADED = ("assert 'pcie_allreduce._C' not in sys.modules, 'the extension was loaded'\n")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PCIE_ALLREDUCE_ENABLE"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


@pytest.mark.parametrize("flag", [None, "0"])
def test_import_and_disabled_engine_plugins_load_neither_the_extension_nor_torch(flag):
    env = {} if flag is None else {"PCIE_ALLREDUCE_ENABLE": flag}
    done = _run("import sys, pcie_allreduce\n" + _NOT_LOADED +
                "assert 'torch' not in sys.modules, 'torch was loaded'\n"
                "from pcie_allreduce.integrations import sglang, vllm\n"
                "vllm.register()\nsglang.register()\n" + _NOT_LOADED, **env)
    assert done.returncode == 0, done.stderr


def test_the_ops_and_their_fakes_are_registered_once_a_name_needs_the_extension():
    done = _run("import sys, torch\nfrom pcie_allreduce import PcieAllReduce\n"
                "from torch._library.simple_registry import singleton\n"
                "for op in ('all_reduce', 'all_reduce_', 'all_reduce_into'):\n"
                "    assert hasattr(torch.ops.pcie_allreduce, op), op\n"
                "    assert singleton.find(f'pcie_allreduce::{op}').fake_impl.kernel, op\n"
                "tools = [m for m in sys.modules if m.startswith('pcie_allreduce.tools')]\n"
                "assert not tools, f'the runtime imported the tools: {tools}'\n")
    assert done.returncode == 0, done.stderr


def test_setup_installs_every_subpackage_of_the_tree():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tree = {".".join(p.parent.relative_to(root / "python").parts)
            for p in (root / "python" / "pcie_allreduce").rglob("__init__.py")}
    setup = ast.parse((root / "setup.py").read_text())
    listed = next(ast.literal_eval(k.value) for node in ast.walk(setup)
                  if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
                  for k in node.keywords if k.arg == "packages")
    assert sorted(listed) == sorted(tree)
