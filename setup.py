"""Builds pcie_allreduce._C through CMake (the one build of the project).

Install with `pip install --no-build-isolation .` so the build uses the torch already in the
environment instead of downloading a second one into an isolated build environment.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Every architecture the kernels are compiled for; torch's CMake config needs its own list
# because it cannot query a GPU on a machine without one.
DEFAULT_TORCH_ARCHS = "8.0;8.6;8.9;9.0;10.0;12.0"


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("PCIE_AR_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        env = dict(os.environ)
        env.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_TORCH_ARCHS)
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DPCIE_AR_WITH_TORCH=ON",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        for var in (
            "PCIE_AR_CUDA_ARCHS",
            "PCIE_AR_WITH_CUDA",
            "PCIE_AR_BUILD_TESTS",
            "PCIE_AR_WERROR",
        ):
            if var in env:
                configure.append(f"-D{var}={env[var]}")
        subprocess.check_call(configure, env=env)
        jobs = env.get("PCIE_AR_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs], env=env)
        built = sorted(build_dir.glob("_C*.so"))
        if not built:
            raise RuntimeError(f"CMake finished but produced no _C*.so in {build_dir}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], target)


setup(
    ext_modules=[CMakeExtension("pcie_allreduce._C")],
    cmdclass={"build_ext": CMakeBuild},
    package_dir={"": "python"},
    packages=[
        "pcie_allreduce",
        "pcie_allreduce.integrations",
        "pcie_allreduce.tuning",
        "pcie_allreduce.tuning.tuner",
        "pcie_allreduce.tools",
        "pcie_allreduce.tools.bench",
        "pcie_allreduce.tools.doctor",
    ],
)
