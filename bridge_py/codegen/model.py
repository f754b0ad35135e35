"""The export table and Python signatures -> plain descriptions of Elixir functions.

The conventions (also in ``../shared/DESIGN.md``):

* instance methods take the ref first; Python parameters without a default are
  positional Elixir parameters; if there are optional positional parameters, a
  trailing ``args`` list carries them; then ``opts \\\\ []`` (Python keyword arguments
  plus ``:__runtime__``);
* constructors are ``new/N``; static methods keep their documented arity with a
  ref (or nil) first, used only to choose the worker;
* exported attributes are zero-argument getters ``name(ref)``.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from bridge_py.codegen.typespecs import typespec
from bridge_py.worker.exports import ExportedClass, ExportTable

Kind = Literal["constructor", "method", "static", "function", "getter"]
Where = Literal["positional", "args", "opts"]

# Elixir words that cannot name a variable, and names the generated code uses itself.
_RESERVED = {
    "after", "and", "catch", "do", "else", "end", "false", "fn", "in", "nil", "not",
    "or", "rescue", "true", "when", "ref", "args", "opts",
}  # fmt: skip


@dataclass
class Param:
    """One Python parameter as the Elixir function exposes it."""

    name: str
    var: str
    spec: str
    where: Where
    default: str | None = None


@dataclass
class Function:
    """One generated Elixir function."""

    name: str
    kind: Kind
    target: str  # the wire name: class, method, "Class.static" or function
    params: list[Param]
    returns: str
    doc: str

    @property
    def positional(self) -> list[Param]:
        """Parameters that are positional Elixir parameters."""
        return [p for p in self.params if p.where == "positional"]

    @property
    def has_args(self) -> bool:
        """Whether the function takes a trailing ``args`` list."""
        return any(p.where == "args" for p in self.params)

    @property
    def takes_ref(self) -> bool:
        """Whether the first Elixir parameter is a ref."""
        return self.kind in ("method", "static", "getter")


@dataclass
class Module:
    """One generated Elixir module (and file)."""

    name: str
    moduledoc: str
    python_name: str
    is_class: bool
    functions: list[Function] = field(default_factory=list)

    @property
    def path(self) -> str:
        """The file path under ``elixir/lib``, as Elixir's Macro.underscore names it."""
        return "/".join(underscore(part) for part in self.name.split(".")) + ".ex"


def underscore(name: str) -> str:
    """``StatelessProcessGroup -> stateless_process_group``, ``NFSWorkspace -> nfs_workspace``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _var(name: str) -> str:
    var = name.lstrip("_") or "arg"
    return var + "_" if var in _RESERVED else var


def _default(value: Any) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    return repr(value)


def _doc(obj: Any, fallback: str) -> str:
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else fallback


def _hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return {}


def _params(
    fn: Any, exported: dict[type, str], drop_first: bool
) -> tuple[list[Param], dict[str, Any]]:
    sig = inspect.signature(fn)
    hints = _hints(fn.__init__ if isinstance(fn, type) else fn)
    params = []
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
        params.append(Param(p.name, _var(p.name), spec, where, _default(p.default)))
    return params, hints


def _returns(hints: dict[str, Any], exported: dict[type, str]) -> str:
    if "return" not in hints:
        return "term()"
    return typespec(hints["return"], exported)


def _class_module(entry: ExportedClass, exported: dict[type, str]) -> Module:
    cls = entry.cls
    module = Module(
        name=entry.elixir_module,
        moduledoc=_doc(cls, f"Python class {entry.name}."),
        python_name=entry.name,
        is_class=True,
    )
    if entry.constructible:
        params, _ = _params(cls, exported, drop_first=False)
        module.functions.append(
            Function(
                name="new",
                kind="constructor",
                target=entry.name,
                params=params,
                returns=exported[cls],
                doc=_doc(cls.__init__, f"Constructs a {entry.name}."),
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
                doc=_doc(fn, f"Python static method {entry.name}.{name}."),
            )
        )
    for name in entry.methods:
        fn = getattr(cls, name)
        params, hints = _params(fn, exported, drop_first=True)
        module.functions.append(
            Function(
                name=name,
                kind="method",
                target=name,
                params=params,
                returns=_returns(hints, exported),
                doc=_doc(fn, f"Python method {entry.name}.{name}."),
            )
        )
    taken = {f.name for f in module.functions}
    class_hints = _hints(cls)
    for name in entry.attributes:
        if name in taken:
            raise ValueError(f"{entry.name}.{name}: an attribute and a method share a name")
        member = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            spec = _returns(_hints(member.fget), exported)
            doc = _doc(member, f"The `{name}` property of a {entry.name}.")
        else:
            spec = typespec(class_hints.get(name, Any), exported)
            doc = f"The `{name}` field of a {entry.name}."
        module.functions.append(Function(name, "getter", name, [], spec, doc))
    return module


def build(table: ExportTable) -> list[Module]:
    """The modules to generate for ``table``, in a stable order."""
    exported = {entry.cls: f"{entry.elixir_module}.t()" for entry in table.classes.values()}
    modules: dict[str, Module] = {}
    for entry in table.classes.values():
        modules[entry.elixir_module] = _class_module(entry, exported)
    for fn in table.functions.values():
        module = modules.setdefault(
            fn.elixir_module,
            Module(
                name=fn.elixir_module,
                moduledoc=table.module_docs.get(
                    fn.elixir_module, f"Functions of {fn.elixir_module}."
                ),
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
                doc=_doc(fn.fn, f"Python function {fn.name}."),
            )
        )
    return sorted(modules.values(), key=lambda m: m.name)
