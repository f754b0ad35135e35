"""Checking arguments against a signature before the call, for clear ``bad_args`` errors.

Python only notices a missing argument or a string where an int belongs deep inside
the callee, if at all. The bridge checks arity against the signature and simple
annotations (int, float, str, bool, bytes, their Optionals and unions) up front, so
the caller learns which argument of which function was wrong; ``torch.dtype``
parameters also accept the wire forms of a dtype (``{:f, 32}``, ``"float32"``).

Everything that can be worked out from a signature is worked out once per function
(:class:`_Plan`), and a function's check is made once (:func:`checker`): a call with
positional arguments only is then one count and the type checks of its annotated
parameters. No call is checked with ``inspect.Signature.bind`` (which costs more than
the rest of a small call), unless it does not fit: ``bind`` then words the error.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bridge_py.worker.codec import CodecError, dtype_from_term


class BadArguments(TypeError):
    """Arguments that do not fit the callee's signature."""


_SIMPLE = (int, float, str, bool, bytes)


@dataclass(frozen=True)
class _Param:
    name: str
    allowed: tuple[type, ...] | None  # simple types to check, or None
    dtype: bool  # annotated torch.dtype: convert from the wire form


@dataclass(frozen=True)
class _Plan:
    """What a call to one function needs checked, worked out once."""

    sig: inspect.Signature
    params: dict[str, _Param]
    positional: tuple[_Param, ...]  # positional parameters, in order
    required: int  # how many leading positional parameters have no default
    var_positional: bool
    keyword_only_required: bool
    any_checks: bool
    # For keyword arguments: the position of each parameter a keyword may name (positional
    # or keyword; keyword-only ones at len(positional)), the names that must be given
    # (without a default, keyword-only ones included) in order of position, and whether
    # unknown names are taken (``**kwargs``).
    by_keyword: dict[str, int]
    must_name: tuple[tuple[str, int], ...]
    var_keyword: bool


@functools.lru_cache(maxsize=2048)
def _plan(fn: Callable[..., Any], drop_first: bool) -> _Plan | None:
    """The plan for ``fn`` (without ``self`` when bound); None when it has no signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if drop_first:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    try:
        # A class's parameters are its constructor's (``__init__`` as the class has it).
        target = typing.cast(Any, fn).__init__ if isinstance(fn, type) else fn
        hints = typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: check arity only
        hints = {}
    params: dict[str, _Param] = {}
    positional: list[_Param] = []
    required = 0
    var_positional = False
    keyword_only_required = False
    by_keyword: dict[str, int] = {}
    must_name: list[tuple[str, int]] = []
    var_keyword = False
    for p in sig.parameters.values():
        hint = hints.get(p.name)
        param = _Param(p.name, _allowed(hint), _takes_dtype(hint))
        params[p.name] = param
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            at = len(positional)
            positional.append(param)
            if p.default is p.empty and required == len(positional) - 1:
                required += 1
            if p.kind is p.POSITIONAL_OR_KEYWORD:
                by_keyword[p.name] = at
        elif p.kind is p.VAR_POSITIONAL:
            var_positional = True
        elif p.kind is p.KEYWORD_ONLY:
            at = len(sig.parameters)  # after every positional one: never filled by position
            by_keyword[p.name] = at
            keyword_only_required = keyword_only_required or p.default is p.empty
        else:
            var_keyword = True
            continue
        if p.default is p.empty and p.kind is not p.VAR_POSITIONAL:
            must_name.append((p.name, at))
    return _Plan(
        sig=sig,
        params=params,
        positional=tuple(positional),
        required=required,
        var_positional=var_positional,
        keyword_only_required=keyword_only_required,
        any_checks=any(p.allowed is not None or p.dtype for p in params.values()),
        by_keyword=by_keyword,
        must_name=tuple(must_name),
        var_keyword=var_keyword,
    )


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


def _takes_dtype(annotation: Any) -> bool:
    if annotation is torch.dtype:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(arg is torch.dtype for arg in typing.get_args(annotation))
    return False


def _fits(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, int) and not isinstance(value, bool) and float in allowed:
        return True  # an integer is a fine float
    return isinstance(value, allowed)


def _checked(param: _Param, value: Any, name: str) -> Any:
    """``value`` for ``param``, converted if it is a dtype; raises BadArguments."""
    if param.dtype and value is not None:
        try:
            return dtype_from_term(value)
        except CodecError as exc:
            raise BadArguments(f"{name}: argument {param.name!r}: {exc}") from None
    if param.allowed is not None and not _fits(value, param.allowed):
        wanted = " or ".join("None" if t is type(None) else t.__name__ for t in param.allowed)
        raise BadArguments(
            f"{name}: argument {param.name!r} must be {wanted}, got {type(value).__name__} "
            f"{value!r:.80}"
        )
    return value


Check = Callable[[list[Any], dict[str, Any]], tuple[list[Any], dict[str, Any]]]
"""A call's check: its arguments, ready to pass (see :func:`prepare_call`); raises
:class:`BadArguments`."""


def checker(fn: Callable[..., Any], name: str) -> Check:
    """The check of calls to ``fn`` (``name`` in its errors): :func:`prepare_call`'s work,
    with everything that does not depend on the arguments worked out once."""
    target = getattr(fn, "__func__", fn)
    return _checker(target, target is not fn, name)


def prepare_call(
    fn: Callable[..., Any], name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Check a call against ``fn``'s signature and return its arguments, ready to pass.

    Raises :class:`BadArguments` naming ``name`` when the call cannot fit. Arguments
    annotated ``torch.dtype`` are converted from their wire form (``{:f, 32}``,
    ``"float32"``); everything else passes through unchanged. ``args`` may be changed
    in place (a converted argument takes the place of its wire form), and so may
    ``kwargs``.
    """
    return checker(fn, name)(args, kwargs)


def _string_keys(kwargs: dict[Any, Any]) -> None:
    """Raise BadArguments unless every keyword is a string (msgpack maps may have others)."""
    if not all(type(key) is str for key in kwargs):
        raise BadArguments("kwargs must be a msgpack map with string keys")


def _unchecked(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    _string_keys(kwargs)
    return args, kwargs


@functools.lru_cache(maxsize=2048)
def _checker(target: Callable[..., Any], drop_first: bool, name: str) -> Check:
    """:func:`checker` for ``target`` (without ``self`` when ``drop_first``)."""
    plan = _plan(target, drop_first)
    if plan is None:
        return _unchecked
    # Positional arguments only (the common call) fit when their count is in
    # [low, high]; a required keyword-only parameter makes every such call miss.
    low = plan.required
    high = len(plan.positional) if not plan.var_positional else sys.maxsize
    if plan.keyword_only_required:
        high = -1
    # The positional parameters that are checked, in order, each with the exact types
    # that pass its check unchanged; a value of any other type is looked at by _checked.
    checks = tuple(
        (at, _passing(param), param)
        for at, param in enumerate(plan.positional)
        if param.allowed is not None or param.dtype
    )
    # The same by name, for the parameters a keyword may fill.
    named = {
        key: (_passing(param), param)
        for key in plan.by_keyword
        if (param := plan.params[key]).allowed is not None or param.dtype
    }

    def check(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        given = len(args)
        if kwargs:
            # Keywords that fit are checked in place by name, as positional arguments are
            # by position; a call that does not fit goes the general way (bind words why).
            if not _fits_keywords(plan, args, kwargs):
                return _prepare(plan, name, args, kwargs)
            for key, value in kwargs.items():
                entry = named.get(key)
                if entry is not None and type(value) not in entry[0]:
                    kwargs[key] = _checked(entry[1], value, name)
        elif not low <= given <= high:
            return _prepare(plan, name, args, kwargs)
        for at, passing, param in checks:
            if at >= given:
                break
            value = args[at]
            if type(value) not in passing:
                args[at] = _checked(param, value, name)
        return args, kwargs

    return check


def _passing(param: _Param) -> frozenset[type]:
    """The types whose values ``_checked(param, ...)`` returns unchanged, without asking
    it: those ``param.allowed`` names (with ``bool`` where ``int`` is, and ``int`` where
    ``float`` is, as :func:`_fits` lets through); none for a dtype (it is converted)."""
    if param.dtype or param.allowed is None:
        return frozenset()
    passing = set(param.allowed)
    if int in passing:
        passing.add(bool)
    if float in passing:
        passing.add(int)
    return frozenset(passing)


def _prepare(
    plan: _Plan, name: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """:func:`prepare_call` by ``plan``, for a call with keywords or with a count of
    positional arguments that does not fit."""
    _string_keys(kwargs)  # (the way in ``check`` takes none that are not)
    # The keywords are matched to the parameters, and ``bind`` words what does not fit.
    if not _fits_keywords(plan, args, kwargs):
        try:
            plan.sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise BadArguments(f"{name}{plan.sig}: {exc}") from None
    if not plan.any_checks:
        return args, kwargs
    # Each argument is checked against the parameter it fills (what ``*args`` or
    # ``**kwargs`` takes is not checked).
    positional = plan.positional
    args = [_checked(p, v, name) for p, v in zip(positional, args, strict=False)] + (
        args[len(positional) :]
    )
    if kwargs:
        params, by_keyword = plan.params, plan.by_keyword
        kwargs = {
            key: _checked(params[key], value, name) if key in by_keyword else value
            for key, value in kwargs.items()
        }
    return args, kwargs


def _fits_keywords(plan: _Plan, args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``fn(*args, **kwargs)`` fits the signature ``plan`` describes, worked out
    without binding; False when it does not, or when that cannot be told this way (a
    keyword that is not a string)."""
    given = len(args)
    if given > len(plan.positional) and not plan.var_positional:
        return False
    by_keyword = plan.by_keyword
    for key in kwargs:
        at = by_keyword.get(key)
        if at is None:
            # unknown, positional-only, or not a name at all
            if not plan.var_keyword or key in plan.params or type(key) is not str:
                return False
        elif at < given:
            return False  # given twice: by position and by name
    # A loop, not all() over a generator: the generator cost ~0.3 us of every keyword call.
    for key, at in plan.must_name:  # noqa: SIM110
        if at >= given and key not in kwargs:
            return False
    return True


def accepts_no_arguments(fn: Callable[..., Any]) -> bool:
    """Whether ``fn()`` fits its signature (then a call without arguments needs no checks).

    False when that cannot be told (no signature): such calls go through
    :func:`prepare_call`, which lets them through.
    """
    target = getattr(fn, "__func__", fn)
    plan = _plan(target, target is not fn)
    return plan is not None and plan.required == 0 and not plan.keyword_only_required
