"""The signatures of the CuPy and NCCL functions baguahvd calls, as the real CuPy states them,
and the argument checks that follow from them.

Each entry is the signature line CuPy's own documentation gives (the first docstring line of
a Cython function, or ``inspect.signature`` of a Python one), recorded from cupy-cuda12x
14.2.0 and 13.6.0. ``tests/unit/test_cupy_conformance.py`` compares every recorded line with
the installed CuPy, so the fakes cannot drift from the real API without a test failing.

:func:`check_call` checks a call against a signature the way a Cython function does before
its body runs: the number and names of the arguments, and the C types, as the real bindings
convert them (measured on both releases): ``intptr_t`` wants a Python ``int`` (or bool) —
not a float, ``None`` or a NumPy integer; ``int`` and ``size_t`` take anything with
``__int__`` (a float too, truncated), ``size_t`` only non-negative; ``bytes``, ``tuple`` and
``str`` want exactly that type.
The fakes call it first in each function, so they refuse what the real function refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SIGNATURES: dict[int, dict[str, str]] = {
    14: {
        "nccl.get_unique_id": "get_unique_id()",
        "nccl.get_version": "get_version()",
        "nccl.groupStart": "groupStart()",
        "nccl.groupEnd": "groupEnd()",
        "nccl.NcclCommunicator": (
            "NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)"
        ),
        "nccl.NcclCommunicator.allReduce": (
            "NcclCommunicator.allReduce(self, intptr_t sendbuf, intptr_t recvbuf, "
            "size_t count, int datatype, int op, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.reduce": (
            "NcclCommunicator.reduce(self, intptr_t sendbuf, intptr_t recvbuf, size_t count, "
            "int datatype, int op, int root, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.broadcast": (
            "NcclCommunicator.broadcast(self, intptr_t sendbuff, intptr_t recvbuff, "
            "size_t count, int datatype, int root, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.bcast": (
            "NcclCommunicator.bcast(self, intptr_t buff, size_t count, int datatype, "
            "int root, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.reduceScatter": (
            "NcclCommunicator.reduceScatter(self, intptr_t sendbuf, intptr_t recvbuf, "
            "size_t recvcount, int datatype, int op, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.allGather": (
            "NcclCommunicator.allGather(self, intptr_t sendbuf, intptr_t recvbuf, "
            "size_t count, int datatype, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.send": (
            "NcclCommunicator.send(self, intptr_t sendbuf, size_t count, int datatype, "
            "int peer, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.recv": (
            "NcclCommunicator.recv(self, intptr_t recvbuf, size_t count, int datatype, "
            "int peer, intptr_t stream)"
        ),
        "nccl.NcclCommunicator.abort": "NcclCommunicator.abort(self)",
        "nccl.NcclCommunicator.destroy": "NcclCommunicator.destroy(self)",
        "nccl.NcclCommunicator.check_async_error": "NcclCommunicator.check_async_error(self)",
        "cuda.Device": "Device(device=None)",
        "cuda.Device.use": "Device.use(self)",
        "cuda.Event": "Event(block=False, disable_timing=False, interprocess=False)",
        "cuda.Event.record": "Event.record(self, stream=None)",
        "cuda.Event.synchronize": "Event.synchronize(self)",
        "cuda.Stream": "Stream(null=False, non_blocking=False, ptds=False, priority=None)",
        "cuda.Stream.wait_event": "_BaseStream.wait_event(self, event)",
        "cuda.Stream.synchronize": "_BaseStream.synchronize(self)",
        "cuda.Stream.from_external": "Stream.from_external(cls, obj)",
        "cuda.ExternalStream": "ExternalStream(ptr, device_id=-1)",
        "cuda.alloc": "alloc(size) -> MemoryPointer",
    },
    13: {
        "nccl.NcclCommunicator": "NcclCommunicator(int ndev, tuple commId, int rank)",
        "cuda.Stream": "Stream(null=False, non_blocking=False, ptds=False)",
        "cuda.Stream.from_external": "",
    },
}
"""Signature lines by CuPy major version; 13 lists only where it differs from 14 (an empty
line: CuPy 13 has no such function)."""

ARGUMENT_ERRORS = (TypeError, ValueError, OverflowError)
"""What a Cython function raises when it refuses its arguments, before its body runs."""


def signature(version: int, name: str) -> str:
    """The signature line of ``name`` in CuPy ``version`` ("" where it does not exist)."""
    if name in SIGNATURES[version]:
        return SIGNATURES[version][name]
    return SIGNATURES[14][name]


@dataclass(frozen=True)
class Parameter:
    name: str
    ctype: str | None
    """The declared C type (``int``, ``intptr_t``, ``bytes``...), None when untyped."""
    has_default: bool
    keyword_only: bool


_POINTERS = ("intptr_t",)
_INTEGERS = ("int", "size_t", "Py_ssize_t", "long", "long long")
_EXACT = {"bytes": bytes, "tuple": tuple, "str": str, "unicode": str}


def parameters(line: str) -> list[Parameter]:
    """The parameters of a signature line, without ``self``/``cls``."""
    match = re.search(r"\((.*)\)", line)
    if match is None:
        raise ValueError(f"not a signature: {line!r}")
    params: list[Parameter] = []
    keyword_only = False
    for part in filter(None, (piece.strip() for piece in match.group(1).split(","))):
        if part == "*":
            keyword_only = True
            continue
        declaration, has_default = part.split("=")[0].strip(), "=" in part
        words = declaration.split()
        name = words[-1]
        ctype = " ".join(words[:-1]) or None
        if name in ("self", "cls"):
            continue
        params.append(Parameter(name, ctype, has_default, keyword_only))
    return params


def check_call(version: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises what CuPy ``version``'s ``name`` raises before its body for these arguments.

    Raises:
        AttributeError: CuPy ``version`` has no ``name``.
        TypeError, OverflowError: as the real function's argument conversion.
    """
    line = signature(version, name)
    if not line:
        raise AttributeError(f"CuPy {version} has no {name}")
    params = parameters(line)
    short = name.rsplit(".", 1)[-1]
    positional = [p for p in params if not p.keyword_only]
    if len(args) > len(positional):
        raise TypeError(
            f"{short}() takes at most {len(positional)} positional arguments "
            f"({len(args)} given)"
        )
    bound: dict[str, Any] = dict(zip((p.name for p in positional), args))
    for key, value in kwargs.items():
        if key in bound:
            raise TypeError(f"{short}() got multiple values for argument '{key}'")
        if key not in {p.name for p in params}:
            raise TypeError(f"{short}() got an unexpected keyword argument '{key}'")
        bound[key] = value
    for param in params:
        if param.name not in bound:
            if not param.has_default:
                raise TypeError(f"{short}() missing required argument '{param.name}'")
            continue
        _check_type(short, param, bound[param.name])


def _check_type(function: str, param: Parameter, value: Any) -> None:
    if param.ctype in _POINTERS:
        if not isinstance(value, int):
            raise TypeError("an integer is required")
        return
    if param.ctype in _INTEGERS:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__int__"):
            raise TypeError("an integer is required")
        if param.ctype == "size_t" and int(value) < 0:
            raise OverflowError("can't convert negative value to size_t")
        return
    exact = _EXACT.get(param.ctype or "")
    if exact is not None and value is not None and type(value) is not exact:
        raise TypeError(
            f"Argument '{param.name}' has incorrect type (expected {param.ctype}, got "
            f"{type(value).__name__})"
        )
