"""The export table and Python signatures -> the modules to generate (``model``), with docs.

The conventions (users' view: docs/guide-elixir.md, "Calling the generated functions";
how the docs are converted: docs/architecture.md, after its first diagram):

* instance methods take the ref first; Python parameters without a default are
  positional Elixir parameters; if there are optional positional parameters, a
  trailing ``args`` list carries them, up to the first that may itself be a list
  (that one and those after it are given by name only, so that ``[7]`` is never
  read as the argument list); then ``opts \\\\ []`` (Python keyword arguments
  plus ``:__runtime__``);
* constructors are ``new/N``; static methods keep their documented arity with a
  ref (or nil) first, used only to choose the worker;
* exported attributes are zero-argument getters ``name(ref)``;
* docs are the Python docstrings as Markdown (``docstrings``), their roles naming
  the Elixir modules and functions (``references``); Python's own boilerplate (the
  inherited "Initialize self. See help(type(self))..." and the signature docstrings
  of dataclasses and namedtuples) gives way to a short generated sentence, and
  ``Args:`` entries (a class docstring's too, for ``new``) move beside the
  parameters they describe; defaults are written as Elixir terms (``nil``, ``%{}``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any

from bridge_py.codegen.docstrings import Converted, DocstringError, to_markdown
from bridge_py.codegen.model import Function, Module, Param, Where
from bridge_py.codegen.references import References
from bridge_py.codegen.typespecs import typespec
from bridge_py.worker.exports import ExportedClass, ExportTable

# Elixir words that cannot name a variable, and names the generated code uses itself.
_RESERVED = {
    "after", "and", "catch", "do", "else", "end", "false", "fn", "in", "nil", "not",
    "or", "rescue", "true", "when", "ref", "args", "opts",
}  # fmt: skip


def _var(name: str) -> str:
    var = name.lstrip("_") or "arg"
    return var + "_" if var in _RESERVED else var


def elixir_term(value: Any) -> str | None:
    """``value`` written as the Elixir term that decodes to it; None if there is none."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        items = [elixir_term(v) for v in value]
        if any(i is None for i in items):
            return None
        body = ", ".join(typing.cast(list[str], items))
        return f"[{body}]" if isinstance(value, list) else f"{{{body}}}"
    if isinstance(value, dict):
        pairs = [(elixir_term(k), elixir_term(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in pairs):
            return None
        return "%{" + ", ".join(f"{k} => {v}" for k, v in pairs) + "}"
    return None


def _default(value: Any, owner: Any, name: str, spec: str) -> str | None:
    """A parameter's default as Markdown: an Elixir term in backticks where one exists.

    A Python enum member (``ReduceOp.SUM``) has none: it reads as its name, as a string
    where the parameter takes one (``"sum"``: ``spec``, its typespec, says), else as
    Python's name, with a word that leaving the argument out gives it."""
    if value is inspect.Parameter.empty:
        return None
    member = getattr(value, "name", None)
    if isinstance(member, str) and not isinstance(value, (str, bytes, type)):
        if "String.t()" in spec:
            return f"`{json.dumps(member.lower())}`"
        enum = type(value).__qualname__.split(".")[0]  # torch's ReduceOp.RedOpType: ReduceOp
        return f"Python's `{enum}.{member}` (leave the argument out for it)"
    if dataclasses.is_dataclass(owner):
        fields = {f.name: f for f in dataclasses.fields(owner)}
        factory = fields[name].default_factory if name in fields else dataclasses.MISSING
        if factory is not dataclasses.MISSING:
            built: object = factory() if factory in (dict, list, tuple) else None
            term = elixir_term(built) if built is not None else None
            return f"`{term}`" if term else f"a new `{getattr(factory, '__name__', factory)}`"
    term = elixir_term(value)
    return f"`{term}`" if term is not None else f"`{value!r}` (Python)"


# Python's own docstrings, which say nothing about the object in hand.
_BOILERPLATE = re.compile(
    r"Initialize self\.\s+See help\(type\(self\)\) for accurate signature\.\s*"
)


def python_doc(obj: Any) -> str:
    """``obj``'s docstring as :func:`inspect.getdoc` has it, less Python's boilerplate."""
    doc = inspect.getdoc(obj) or ""
    doc = _BOILERPLATE.sub("", doc).strip()
    if isinstance(obj, type) and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc, re.S):
        return ""  # dataclasses and namedtuples document their signature by default
    return doc


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return {}


def _params(
    fn: Any, exported: dict[type, str], drop_first: bool
) -> tuple[list[Param], dict[str, Any]]:
    sig = inspect.signature(fn)
    untyped: Any = fn  # a class's __init__ is looked up as Python does (inherited too)
    hints = _hints(untyped.__init__ if isinstance(fn, type) else fn)
    params: list[Param] = []
    items = list(sig.parameters.values())[1 if drop_first else 0 :]
    for p in items:
        if p.kind is p.VAR_KEYWORD:
            continue
        if p.kind is p.KEYWORD_ONLY:
            where: Where = "opts"
        elif p.kind is p.VAR_POSITIONAL or p.default is not p.empty:
            where = "args"
        else:
            where = "positional"
        spec = typespec(hints.get(p.name, p.annotation), exported)
        if p.kind is p.VAR_POSITIONAL:
            spec = f"[{spec}]"
        if where == "args" and p.kind is not p.VAR_POSITIONAL:
            hint = hints.get(p.name, p.annotation)
            if _may_be_list(hint) or any(q.where == "named" for q in params):
                where = "named"
        default = _default(p.default, fn, p.name, spec)
        params.append(Param(p.name, _var(p.name), spec, where, default))
    return params, hints


def _may_be_list(hint: Any) -> bool:
    """Whether a value of Python type ``hint`` may come from Elixir as a list: any value
    (no annotation, ``Any``, ``object``) or a sequence type."""
    if hint in (inspect.Parameter.empty, Any, object) or isinstance(hint, str):
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_may_be_list(arg) for arg in typing.get_args(hint))
    return (
        origin is not None
        and issubclass(origin, (list, collections.abc.Sequence))
        and (origin not in (tuple, str, bytes))
    )


def _returns(hints: dict[str, Any], exported: dict[type, str]) -> str:
    if "return" not in hints:
        return "term()"
    return typespec(hints["return"], exported)


def _class_module(entry: ExportedClass, exported: dict[type, str]) -> Module:
    cls = entry.cls
    module = Module(
        name=entry.elixir_module,
        python_doc=python_doc(cls),
        fallback=f"A Python `{entry.name}`, held by a worker.",
        python_name=entry.name,
        is_class=True,
        origin=cls,
    )
    init: Any = cls  # its __init__, looked up as Python does
    if entry.constructible:
        params, _ = _params(cls, exported, drop_first=False)
        module.functions.append(
            Function(
                name="new",
                kind="constructor",
                target=entry.name,
                params=params,
                returns=exported[cls],
                python_doc=python_doc(init.__init__),
                fallback=f"Constructs a `{entry.name}`.",
                origin=init.__init__,
            )
        )
    for name in entry.static_methods:
        fn = getattr(cls, name)
        params, hints = _params(fn, exported, drop_first=False)
        module.functions.append(
            Function(
                name=name,
                kind="static",
                target=f"{entry.name}.{name}",
                params=params,
                returns=_returns(hints, exported),
                python_doc=python_doc(fn),
                fallback=f"The static method `{name}` of `{entry.name}`.",
                origin=fn,
            )
        )
    # each method under its own name, then the Elixir names that call another method
    for alias, name in [(m, m) for m in entry.methods] + list(entry.elixir_aliases):
        fn = getattr(cls, name)
        params, hints = _params(fn, exported, drop_first=True)
        module.functions.append(
            Function(
                name=alias,
                kind="method",
                target=name,
                params=params,
                returns=_returns(hints, exported),
                python_doc=python_doc(fn),
                fallback=f"The method `{name}` of a `{entry.name}`.",
                origin=fn,
            )
        )
    _settle_arities(module)
    taken = {f.name for f in module.functions}
    class_hints = _hints(cls)
    for name in entry.attributes:
        if name in taken:
            raise ValueError(f"{entry.name}.{name}: an attribute and a method share a name")
        member = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            spec = _returns(_hints(member.fget), exported)
            doc, fallback = python_doc(member), f"The `{name}` property of a `{entry.name}`."
        else:
            spec = typespec(class_hints.get(name, Any), exported)
            doc, fallback = "", f"The `{name}` field of a `{entry.name}`."
        module.functions.append(
            Function(name, "getter", name, [], spec, doc, fallback, origin=member if doc else None)
        )
    return module


def _settle_arities(module: Module) -> None:
    """Give functions that share a name distinct arities: the shortest keeps its defaults,
    a longer one whose arities would overlap is defined at its full arity only (as
    ``dispatch/6``, vLLM 0.34's dispatch, beside ``dispatch/3..5``, the router-logits one).
    ValueError where two full arities are equal."""
    taken: dict[str, set[int]] = {}
    for fn in sorted(module.functions, key=lambda f: (f.name, f.arity)):
        used = taken.setdefault(fn.name, set())
        if used & set(fn.arities):
            fn.defaults = False
        if fn.arity in used:
            raise ValueError(f"{module.name}.{fn.name}/{fn.arity} would be generated twice")
        used.update(fn.arities)


def _convert(doc: str, fallback: str, where: str, **how: Any) -> Converted:
    """``doc`` as Markdown (``fallback`` when nothing of it is left); errors name ``where``."""
    try:
        converted = to_markdown(doc, **how)
        if not converted.text:
            lifted = converted
            converted = to_markdown(fallback, **how)
            converted = dataclasses.replace(
                converted,
                params=lifted.params,
                returns=lifted.returns,
                raises=lifted.raises,
            )
    except DocstringError as exc:
        raise DocstringError(f"the docstring of {where}: {exc}") from exc
    return converted


def document(modules: list[Module]) -> None:
    """Write every module's and function's Markdown docs from their Python docstrings."""
    references = References(modules)
    for module in modules:
        resolve = references.resolver(module)
        constructor = next((f for f in module.functions if f.kind == "constructor"), None)
        converted = _convert(
            module.python_doc,
            module.fallback,
            module.name,
            resolve=resolve,
            params=[p.name for p in constructor.params] if constructor else (),
        )
        module.moduledoc = converted.text
        for fn in module.functions:
            own = _convert(
                fn.python_doc,
                fn.fallback,
                f"{module.name}.{fn.name}",
                resolve=resolve,
                params=[p.name for p in fn.params],
                results=True,
            )
            fn.doc, fn.returns_doc, fn.errors = own.text, own.returns, own.raises
            twin = next((f for f in module.functions if f.name == fn.python_name), None)
            if fn.name != fn.python_name and twin is not None:  # an alias
                fn.doc += f"\n\nThe same call as `{twin.name}/{twin.arity}`."
            for p in fn.params:
                # A class docstring's Args describe the constructor's parameters.
                inherited = converted.params if fn is constructor else {}
                p.doc = own.params.get(p.name) or inherited.get(p.name, "")


def build(table: ExportTable) -> list[Module]:
    """The modules to generate for ``table``, in a stable order, with their docs."""
    exported = {entry.cls: f"{entry.elixir_module}.t()" for entry in table.classes.values()}
    modules: dict[str, Module] = {}
    for entry in table.classes.values():
        modules[entry.elixir_module] = _class_module(entry, exported)
    for fn in table.functions.values():
        module = modules.setdefault(
            fn.elixir_module,
            Module(
                name=fn.elixir_module,
                python_doc=inspect.cleandoc(table.module_docs.get(fn.elixir_module, "")),
                fallback=f"Functions of {fn.elixir_module}.",
                python_name="",
                is_class=False,
            ),
        )
        params, hints = _params(fn.fn, exported, drop_first=False)
        module.functions.append(
            Function(
                name=fn.name,
                kind="function",
                target=fn.name,
                params=params,
                returns=_returns(hints, exported),
                python_doc=python_doc(fn.fn),
                fallback=f"The function `{fn.name}`.",
                origin=fn.fn,
            )
        )
    ordered = sorted(modules.values(), key=lambda m: m.name)
    document(ordered)
    return ordered
