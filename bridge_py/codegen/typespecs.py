"""Python annotations -> Elixir typespecs, for the generated ``@spec`` s and docs."""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from typing import Any

import torch

_SIMPLE: dict[Any, str] = {
    int: "integer()",
    float: "float()",
    str: "String.t()",
    bytes: "binary()",
    bool: "boolean()",
    type(None): "nil",
    None: "nil",
    torch.Tensor: "VllmBridge.Tensor.t()",
    torch.dtype: "VllmBridge.Tensor.type()",
    torch.device: "String.t()",
    torch.Size: "tuple()",
    # Unparameterized containers: any of their kind (typing.Tuple's args are (), as
    # tuple[()]'s, which is the empty tuple).
    tuple: "tuple()",
    typing.Tuple: "tuple()",  # noqa: UP006  (the unparameterized one, not tuple[()])
    list: "list()",
    dict: "map()",
}


def typespec(annotation: Any, exported: dict[type, str]) -> str:
    """The typespec for ``annotation``; ``exported`` maps classes to their module's t()."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return "term()"
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    if isinstance(annotation, type) and annotation in exported:
        return exported[annotation]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        parts: list[str] = []
        for arg in args:
            spec = typespec(arg, exported)
            if spec not in parts:
                parts.append(spec)
        if "term()" in parts:
            return "term()"
        # nil last reads best: "integer() | nil".
        parts.sort(key=lambda p: p == "nil")
        return " | ".join(parts)
    if origin in (list, collections.abc.Sequence, collections.abc.Iterable, set, frozenset):
        return f"[{typespec(args[0], exported)}]" if args else "list()"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return "tuple()"
        return "{" + ", ".join(typespec(a, exported) for a in args) + "}"
    if origin in (dict, collections.abc.Mapping):
        if args:
            key, value = (typespec(a, exported) for a in args)
            return f"%{{optional({key}) => {value}}}"
        return "map()"
    if isinstance(annotation, type) and not _is_plain_value(annotation):
        # An object without a value encoding comes back as a ref.
        return "VllmBridge.Ref.t()"
    return "term()"


def _is_plain_value(klass: type) -> bool:
    return klass in (int, float, str, bytes, bool, list, dict, tuple)
