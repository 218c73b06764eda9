"""Build hooks: ships the CUDA sources inside the package as ``baguahvd/_csrc``, and builds
the host copy extension where a C compiler is there.

All metadata lives in setup.cfg. The kernels are compiled at run time by NVRTC (through
CuPy), so a wheel only needs the ``csrc/*.cu`` and ``csrc/*.cuh`` text next to the Python
code; ``baguahvd.kernels.sources`` looks for ``baguahvd/_csrc`` first and falls back to the
repository's ``csrc/`` for editable installs and source checkouts.

``csrc/host_copy.c`` becomes ``baguahvd.kernels._host_copy`` (the copies of a fused CPU
allreduce in one call). It is optional: without a compiler, or if it fails to build, the
install goes on and ``baguahvd.kernels.host_copy`` copies with torch instead.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"
PACKAGED = Path("baguahvd") / "_csrc"


def cuda_sources() -> list[Path]:
    """The CUDA files to ship; fails the build if the source tree lost them."""
    files = sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.cuh"))
    if not files:
        raise FileNotFoundError(f"no CUDA sources in {CSRC}; the sdist must include csrc/")
    return files


class BuildPyWithCudaSources(build_py):
    """build_py that also copies csrc/*.cu and csrc/*.cuh into baguahvd/_csrc."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads csrc/ where it is
        target = Path(self.build_lib) / PACKAGED
        self.mkpath(str(target))
        for source in cuda_sources():
            self.copy_file(str(source), str(target / source.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs += [str(Path(self.build_lib) / PACKAGED / s.name) for s in cuda_sources()]
        return outputs


HOST_COPY = Extension(
    "baguahvd.kernels._host_copy",
    sources=["csrc/host_copy.c"],
    extra_compile_args=["-O2"],
    optional=True,
)

setup(cmdclass={"build_py": BuildPyWithCudaSources}, ext_modules=[HOST_COPY])
