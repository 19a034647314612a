"""What importing the package costs: nothing heavy until a communicator or the ops are used."""

import os
import subprocess
import sys

import pytest

_NOT_LOADED = "assert 'pcie_allreduce._C' not in sys.modules, 'the extension was loaded'\n"


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PCIE_ALLREDUCE_ENABLE"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


@pytest.mark.parametrize("flag", [None, "0"])
def test_import_and_disabled_engine_plugins_load_neither_the_extension_nor_torch(flag):
    env = {} if flag is None else {"PCIE_ALLREDUCE_ENABLE": flag}
    done = _run(
        "import sys, pcie_allreduce\n"
        + _NOT_LOADED
        + "assert 'torch' not in sys.modules, 'torch was loaded'\n"
        "from pcie_allreduce.integrations import sglang, vllm\n"
        "vllm.register()\nsglang.register()\n"
        + _NOT_LOADED
        + "assert 'torch' not in sys.modules, 'torch was loaded'\n",
        **env,
    )
    assert done.returncode == 0, done.stderr


def test_enabled_engine_plugins_without_their_engine_both_warn_and_neither_raises():
    """SGLang's register() raised ModuleNotFoundError where vLLM's warned; both now warn, name
    what is missing, and leave the process running (this venv has neither engine)."""
    done = _run(
        "import importlib.util, sys\n"
        "assert not importlib.util.find_spec('vllm') and not importlib.util.find_spec("
        "'sglang'), 'an engine is installed here'\n"
        "from pcie_allreduce.integrations import sglang, vllm\n"
        "vllm.register()\nsglang.register()\nprint('still running')\n",
        PCIE_ALLREDUCE_ENABLE="1",
    )
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr
    assert "vLLM's CUDA communicator cannot be imported" in done.stderr, done.stderr
    assert "SGLang's plugin hooks cannot be imported (ModuleNotFoundError" in done.stderr, (
        done.stderr
    )


def test_the_runtime_imports_no_tool_at_module_level():
    """The tools (CLI, bench, tune, topo, doctor, the tuner) stay apart: a runtime module reaches
    the tuner only inside PcieAllReduce.tune()."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[3] / "python" / "pcie_allreduce"
    tools = (
        "pcie_allreduce.tools",
        "pcie_allreduce.cli",
        "pcie_allreduce.__main__",
        "pcie_allreduce.tuning.tuner",
        "pcie_allreduce.tuning.decision",
        "pcie_allreduce.testing",
    )
    for path in sorted(package.rglob("*.py")):
        name = ".".join(("pcie_allreduce", *path.relative_to(package).with_suffix("").parts))
        if name.startswith(tools):
            continue
        parent = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                base = parent.rsplit(".", node.level - 1)[0] if node.level else ""
                target = ".".join(p for p in (base, node.module) if p).removesuffix(".__init__")
                targets = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            assert not [t for t in targets if t.startswith(tools)], (name, targets)


def test_setup_installs_every_subpackage_of_the_tree():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    tree = {
        ".".join(p.parent.relative_to(root / "python").parts)
        for p in (root / "python" / "pcie_allreduce").rglob("__init__.py")
    }
    setup = ast.parse((root / "setup.py").read_text())
    listed = next(
        ast.literal_eval(k.value)
        for node in ast.walk(setup)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
        for k in node.keywords
        if k.arg == "packages"
    )
    assert sorted(listed) == sorted(tree)
