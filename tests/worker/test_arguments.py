"""prepare_call against Python's own binding: the same calls fit, the same calls fail.

prepare_call works out whether a call fits a signature without ``inspect.Signature.bind``
(it costs more than a small call). Here every combination of a few positional and
keyword arguments is tried on functions with every kind of parameter: prepare_call
raises BadArguments exactly when ``bind`` raises, and otherwise the call it hands back
binds to the same arguments as the one it was given.
"""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bridge_py.worker import arguments
from bridge_py.worker.arguments import BadArguments, checker, prepare_call
from tests.worker.sample_exports import Counter


def plain(a, b=2, *, c, d=4):  # type: ignore[no-untyped-def]
    return (a, b, c, d)


def positional_only(a, b=2, /, c=3):  # type: ignore[no-untyped-def]
    return (a, b, c)


def var_both(a, *args, b=2, **kwargs):  # type: ignore[no-untyped-def]
    return (a, args, b, kwargs)


def only_kwargs(a, /, **kwargs):  # type: ignore[no-untyped-def]
    return (a, kwargs)


def annotated(
    n: int, x: float = 1.0, *, name: str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Any, ...]:
    return (n, x, name, dtype)


FUNCTIONS = [plain, positional_only, var_both, only_kwargs, annotated]
VALUES = [1, 2.5]
NAMES = ["a", "b", "c", "d", "n", "x", "name", "args", "kwargs", "other"]


def _cases() -> list[tuple[list[Any], dict[str, Any]]]:
    cases = []
    for count in range(4):
        args = [7 + i for i in range(count)]
        for size in range(3):
            for keys in itertools.combinations(NAMES, size):
                cases.append((args, {key: VALUES[i % 2] for i, key in enumerate(keys)}))
    return cases


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_prepare_call_fits_what_python_binds(fn: Callable[..., Any]) -> None:
    sig = inspect.signature(fn)
    for args, kwargs in _cases():
        try:
            expected = sig.bind(*args, **kwargs)
        except TypeError:
            expected = None
        try:
            got_args, got_kwargs = prepare_call(fn, fn.__name__, list(args), dict(kwargs))
        except BadArguments as exc:
            if expected is not None:
                # A type check may refuse what binds (annotated: an int where a str goes).
                assert fn is annotated and "must be" in str(exc), (args, kwargs, exc)
            continue
        assert expected is not None, f"{fn.__name__}{sig} took {args} {kwargs}"
        assert sig.bind(*got_args, **got_kwargs).arguments == expected.arguments, (args, kwargs)


def test_keyword_arguments_are_checked_and_converted() -> None:
    args, kwargs = prepare_call(annotated, "annotated", [1], {"x": 2, "dtype": "bfloat16"})
    assert args == [1] and kwargs == {"x": 2, "dtype": torch.bfloat16}
    with pytest.raises(BadArguments, match="argument 'name' must be str or None, got int"):
        prepare_call(annotated, "annotated", [1], {"name": 5})
    with pytest.raises(BadArguments, match="multiple values for argument 'n'"):
        prepare_call(annotated, "annotated", [1], {"n": 2})
    with pytest.raises(BadArguments, match="unexpected keyword argument 'other'"):
        prepare_call(annotated, "annotated", [1], {"other": 2})
    with pytest.raises(BadArguments, match="missing a required argument: 'c'"):
        prepare_call(plain, "plain", [1], {"d": 2})


def positional_dtype(n: int, dtype: torch.dtype | None = None, x: float = 0.0) -> None:
    pass


class _Int(int):
    pass


def test_positional_arguments_are_checked_and_converted_as_by_keyword() -> None:
    # checker's own way for positional arguments (one count, the annotated parameters'
    # checks) answers as the way with keywords (_prepare) and as the type checks do.
    def both(args: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        got = prepare_call(positional_dtype, "positional_dtype", list(args), {})
        names = ["n", "dtype", "x"][: len(args)]
        by_name = prepare_call(
            positional_dtype, "positional_dtype", [], dict(zip(names, args, strict=True))
        )
        assert got[0] == [by_name[1][name] for name in names]
        return got

    assert both([1, ["f", 32], 2]) == ([1, torch.float32, 2], {})
    assert both([True, "bfloat16"]) == ([True, torch.bfloat16], {})  # a bool is an int
    assert both([_Int(3), None, _Int(4)])[0] == [3, None, 4]  # subclasses pass
    assert both([1]) == ([1], {})
    for args, message in (
        ([1.5], "positional_dtype: argument 'n' must be int, got float 1.5"),
        ([1, None, "2"], "positional_dtype: argument 'x' must be float, got str '2'"),
        ([1, None, True], "argument 'x' must be float, got bool True"),
        ([1, "float33"], "positional_dtype: argument 'dtype': "),
        ([], "missing a required argument: 'n'"),
        ([1, None, 2.0, 4], "too many positional arguments"),
    ):
        with pytest.raises(BadArguments, match=re.escape(message)):
            prepare_call(positional_dtype, "positional_dtype", list(args), {})


def test_a_check_is_made_once_per_function_and_name() -> None:
    assert checker(annotated, "annotated") is checker(annotated, "annotated")
    assert checker(annotated, "other") is not checker(annotated, "annotated")
    # A bound method's check is its function's, without self.
    counter = Counter()
    assert checker(counter.incr, "Counter.incr") is checker(Counter().incr, "Counter.incr")
    with pytest.raises(
        BadArguments, match=re.escape("Counter.incr: argument 'by' must be int or None")
    ):
        checker(counter.incr, "Counter.incr")(["one"], {})


def _outcome(check: Callable[..., tuple[list[Any], dict[str, Any]]], *call: Any) -> object:
    """What ``check(*call, args, kwargs)`` gives (fresh copies of the last two), or its
    BadArguments."""
    *head, args, kwargs = call
    try:
        return check(*head, list(args), dict(kwargs))
    except BadArguments as exc:
        return f"BadArguments: {exc}"


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_calls_with_keywords_are_answered_as_the_general_way_answers_them(
    fn: Callable[..., Any],
) -> None:
    # checker's own way for keywords (each names a parameter not given by position)
    # gives what _prepare (which matches every keyword, and binds to word an error)
    # gives: the same arguments, converted alike, or the same error.
    plan = arguments._plan(fn, False)
    assert plan is not None
    values = [1, 2.5, "s", None, "bfloat16", True]
    for args, kwargs in _cases():
        for value in values:
            named = {key: value for key in kwargs}
            fast = _outcome(prepare_call, fn, "f", args, named)
            general = _outcome(arguments._prepare, plan, "f", args, named)
            assert fast == general, (fn.__name__, args, named)


def test_keywords_that_are_not_strings_are_refused_whatever_the_signature() -> None:
    for fn in [*FUNCTIONS, print]:  # print: no signature to check against
        with pytest.raises(BadArguments, match="kwargs must be a msgpack map with string keys"):
            prepare_call(fn, "f", [1], {1: 2})  # type: ignore[dict-item]
