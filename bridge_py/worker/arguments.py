"""Checking arguments against a signature before the call, for clear ``bad_args`` errors.

Python only notices a missing argument or a string where an int belongs deep inside
the callee, if at all. The bridge checks arity against the signature and simple
annotations (int, float, str, bool, bytes, their Optionals and unions) up front, so
the caller learns which argument of which function was wrong.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from bridge_py.worker.codec import CodecError, dtype_from_term


class BadArguments(TypeError):
    """Arguments that do not fit the callee's signature."""


_SIMPLE = (int, float, str, bool, bytes)


@functools.lru_cache(maxsize=1024)
def _signature(
    fn: Callable[..., Any], drop_first: bool
) -> tuple[inspect.Signature | None, dict[str, Any]]:
    """The call signature of ``fn`` (without ``self`` when bound) and its type hints."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, {}
    if drop_first:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # unresolvable forward references: check arity only
        hints = {}
    return sig, hints


def _allowed(annotation: Any) -> tuple[type, ...] | None:
    """The simple types an annotation admits, or None when we do not check it."""
    if annotation in _SIMPLE:
        return (annotation,)
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        allowed: list[type] = []
        for arg in typing.get_args(annotation):
            if arg is type(None):
                allowed.append(type(None))
                continue
            inner = _allowed(arg)
            if inner is None:
                return None
            allowed.extend(inner)
        return tuple(allowed)
    return None


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, int) and not isinstance(value, bool) and float in allowed:
        return True  # an integer is a fine float
    return isinstance(value, allowed)


def _takes_dtype(annotation: Any) -> bool:
    if annotation is torch.dtype:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(arg is torch.dtype for arg in typing.get_args(annotation))
    return False


def prepare_call(
    fn: Callable[..., Any], name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Check a call against ``fn``'s signature and return its arguments, ready to pass.

    Raises :class:`BadArguments` naming ``name`` when the call cannot fit. Arguments
    annotated ``torch.dtype`` are converted from their wire form (``{:f, 32}``,
    ``"float32"``); everything else passes through unchanged.
    """
    target = getattr(fn, "__func__", fn)
    sig, hints = _signature(target, target is not fn)
    if sig is None:
        return args, kwargs
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise BadArguments(f"{name}{sig}: {exc}") from None
    converted = False
    for param, value in bound.arguments.items():
        hint = hints.get(param)
        if value is not None and _takes_dtype(hint):
            try:
                bound.arguments[param] = dtype_from_term(value)
            except CodecError as exc:
                raise BadArguments(f"{name}: argument {param!r}: {exc}") from None
            converted = True
            continue
        allowed = _allowed(hint)
        if allowed is not None and not _fits(value, allowed):
            wanted = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise BadArguments(
                f"{name}: argument {param!r} must be {wanted}, got {type(value).__name__} "
                f"{value!r:.80}"
            )
    if not converted:
        return args, kwargs
    return list(bound.args), dict(bound.kwargs)
