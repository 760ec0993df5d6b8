"""ctypes bindings of the kernel library, checked at load time against the header that declares it.

ctypes trusts whatever argument types it is given: a binding that says int64_t where the C code takes
int reads garbage or crashes the process. So the bindings state the prototypes they call (in C, next
to the Python code that calls them), and before any function is bound these must equal the header's
declarations, names included (a swapped pair of same-typed parameters is a mismatch too). The compiler
checks the sources against the same header, so a library that passes both checks is called as it was
built. argtypes and restype are then derived from the header's prototypes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

from kvyard.kernels.header import CType, Prototype, parse_prototypes

_SCALARS: dict[str, type[Any]] = {
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "int64_t": ctypes.c_int64,
    "int8_t": ctypes.c_int8,
    "uint16_t": ctypes.c_uint16,
}


class KernelBindingError(RuntimeError):
    """The library, its header and the bindings disagree: a bug in kvyard, not a property of the machine."""


def bind_functions(library: ctypes.CDLL, header_text: str, bindings_text: str) -> dict[str, Callable[..., Any]]:
    """The library's functions by name, typed from the header once it agrees with the bindings' prototypes."""
    header = parse_prototypes(header_text)
    check_prototypes(header, parse_prototypes(bindings_text))
    return {name: _bind(library, prototype) for name, prototype in header.items()}


def check_prototypes(header: Mapping[str, Prototype], bindings: Mapping[str, Prototype]) -> None:
    """Raise KernelBindingError listing every function whose declaration differs between the two."""
    problems = [f"{name}: the bindings call it but the header does not declare it" for name in bindings.keys() - header]
    problems += [f"{name}: the header declares it but nothing binds it" for name in header.keys() - bindings]
    for name in header.keys() & bindings.keys():
        if header[name] != bindings[name]:
            problems.append(
                f"{name}: {_difference(header[name], bindings[name])}\n"
                f"    header:   {header[name]}\n    bindings: {bindings[name]}"
            )
    if problems:
        raise KernelBindingError(
            "the kernel header (kvyard/kernels/csrc/kvyard_kernels.h) and the Python bindings disagree:\n  "
            + "\n  ".join(sorted(problems))
        )


def _difference(header: Prototype, bindings: Prototype) -> str:
    if header.returns != bindings.returns:
        return f"returns {header.returns} in the header, {bindings.returns} in the bindings"
    if len(header.parameters) != len(bindings.parameters):
        return f"takes {len(header.parameters)} parameters in the header, {len(bindings.parameters)} in the bindings"
    for number, (ours, theirs) in enumerate(zip(header.parameters, bindings.parameters), start=1):
        if ours != theirs:
            return f"parameter {number} is `{ours}` in the header, `{theirs}` in the bindings"
    return "the declarations differ"


def _bind(library: ctypes.CDLL, prototype: Prototype) -> Callable[..., Any]:
    try:
        function = getattr(library, prototype.name)
    except AttributeError:
        raise KernelBindingError(
            f"{prototype.name}: declared in the kernel header, but the library {library._name} does not export it"
        ) from None
    function.restype = None if prototype.returns == CType("void") else _ctype(prototype.returns)
    function.argtypes = [_ctype(parameter.type) for parameter in prototype.parameters]
    return function


def _ctype(c_type: CType) -> type[Any]:
    return ctypes.c_void_p if c_type.pointer else _SCALARS[c_type.base]
