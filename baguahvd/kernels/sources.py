"""Where the CUDA sources are, and the single translation unit NVRTC compiles.

A built wheel carries them as ``baguahvd/_csrc`` (copied by ``setup.py``); an editable
install or a source checkout reads the repository's ``csrc/`` directly.
"""

from __future__ import annotations

from pathlib import Path

HEADER_FILE = "baguahvd_math.cuh"
"""The per-element math shared by every kernel file."""

SOURCE_FILES = ("minmax_uint8.cu", "elementwise.cu")
"""One file per kernel family, in the order they are concatenated for NVRTC."""

NVRTC_OPTIONS = ("-DBAGUAHVD_NVRTC", "-std=c++17")
"""Options for NVRTC: kernels only (no host launchers), C++17."""

_INCLUDE_LINE = f'#include "{HEADER_FILE}"'


def source_dir() -> Path:
    """Returns the directory holding the CUDA sources.

    Raises:
        FileNotFoundError: neither the packaged nor the repository copy exists.
    """
    package = Path(__file__).resolve().parent.parent
    candidates = (package / "_csrc", package.parent / "csrc")
    for candidate in candidates:
        if (candidate / HEADER_FILE).is_file():
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"baguahvd CUDA sources not found (searched {searched}); reinstall baguahvd"
    )


def nvrtc_source(directory: Path | None = None) -> str:
    """Returns every kernel file with the shared header inlined once, as one source string.

    Inlining (rather than an include path) makes the string itself the whole program, so a
    compile cache keyed on it can never serve kernels built from an older header.
    """
    directory = source_dir() if directory is None else directory
    header = (directory / HEADER_FILE).read_text(encoding="utf-8")
    parts = [line for line in header.splitlines() if line.strip() != "#pragma once"]
    for name in SOURCE_FILES:
        text = (directory / name).read_text(encoding="utf-8")
        parts.append(f"// ---- {name}")
        parts.extend(line for line in text.splitlines() if line.strip() != _INCLUDE_LINE)
    return "\n".join(parts) + "\n"
