"""The export table: the only way into a worker.

A client can reach exactly the classes, functions, methods and attributes listed
here, by their exported names, and nothing else: no other module, no builtins, no
dunder attribute (refused even if someone lists one). The code generator reads the
same table to write the Elixir modules, so the API on both sides is one list.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class NotExported(LookupError):
    """A name the export table does not list."""


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


@dataclass(frozen=True)
class ExportedClass:
    """A class clients may construct and whose listed members they may use.

    ``name`` is the wire name ("StatelessProcessGroup"); ``elixir_module`` the
    generated module. ``static_methods`` are reached as functions named
    ``"<name>.<method>"``. ``attributes`` are fields and properties, read with
    get_attr (zero-argument getters in Elixir).

    Calls on one object run one at a time, in the order they arrived (``sequencer``).
    ``unordered`` names the ``methods`` that do not wait for their turn: methods made to
    be called while another call on the object waits, such as a MessageQueue's
    ``shutdown``, which ends its ``dequeue``. Only a method that is safe to run beside
    any other method of its object belongs here.

    ``elixir_aliases`` are ``(elixir_name, method)`` pairs: one more generated function,
    ``elixir_name``, that calls the exported ``method`` (a name an earlier API gave it, as
    ``dispatch`` for vLLM 0.34's ``dispatch_router_logits``). Codegen only: the wire
    knows the method by its own name.
    """

    name: str
    cls: type
    elixir_module: str
    methods: tuple[str, ...] = ()
    static_methods: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    constructible: bool = True
    unordered: tuple[str, ...] = ()
    elixir_aliases: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ExportedFunction:
    """A module function clients may call, by its wire name."""

    name: str
    fn: Callable[..., Any]
    elixir_module: str


@dataclass
class ExportTable:
    """Lookups by exported name; everything not listed raises :class:`NotExported`."""

    classes: dict[str, ExportedClass] = field(default_factory=dict)
    functions: dict[str, ExportedFunction] = field(default_factory=dict)
    # Elixir module name -> moduledoc, for modules that hold functions only.
    module_docs: dict[str, str] = field(default_factory=dict)
    # Lookups by type, filled as types are met (the table does not change once built).
    _by_type: dict[type, ExportedClass | None] = field(default_factory=dict, repr=False)
    _names: dict[type, str] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        classes: Iterable[ExportedClass],
        functions: Iterable[ExportedFunction] = (),
        module_docs: dict[str, str] | None = None,
    ) -> ExportTable:
        """A table from its entries; checks that every listed member exists."""
        table = cls(module_docs=dict(module_docs or {}))
        for entry in classes:
            if _is_dunder(entry.name):
                raise ValueError(f"class {entry.name}: dunder names cannot be exported")
            for member in (*entry.methods, *entry.static_methods, *entry.attributes):
                if _is_dunder(member):
                    raise ValueError(f"{entry.name}.{member}: dunder names cannot be exported")
            for member in (*entry.methods, *entry.static_methods):
                if not callable(getattr(entry.cls, member, None)):
                    raise ValueError(f"{entry.name}.{member} is not a method of {entry.cls}")
            for member in entry.unordered:
                if member not in entry.methods:
                    raise ValueError(
                        f"{entry.name}.{member} is unordered but not an exported method"
                    )
            for alias, member in entry.elixir_aliases:
                if member not in entry.methods or _is_dunder(alias):
                    raise ValueError(
                        f"{entry.name}: the Elixir alias {alias!r} must name an exported "
                        f"method, not {member!r}"
                    )
            table.classes[entry.name] = entry
        for fn in functions:
            if any(_is_dunder(part) for part in fn.name.split(".")):
                raise ValueError(f"function {fn.name}: dunder names cannot be exported")
            table.functions[fn.name] = fn
        return table

    # -- lookups used by the dispatcher --------------------------------------------

    def constructor(self, name: str) -> type:
        """The class exported as ``name``, if it may be constructed."""
        entry = self.classes.get(name)
        if entry is None or not entry.constructible:
            raise NotExported(f"class {name!r} is not exported")
        return entry.cls

    def function(self, name: str) -> Callable[..., Any]:
        """A module function, or a static method named ``"Class.method"``."""
        fn = self.functions.get(name)
        if fn is not None:
            return fn.fn
        class_name, _, method = name.rpartition(".")
        entry = self.classes.get(class_name)
        if entry is not None and method in entry.static_methods:
            return getattr(entry.cls, method)
        raise NotExported(f"function {name!r} is not exported")

    def _entry_of(self, obj: Any) -> ExportedClass | None:
        klass = type(obj)
        try:
            return self._by_type[klass]
        except KeyError:
            pass
        found = None
        for base in klass.__mro__:
            found = next((e for e in self.classes.values() if e.cls is base), None)
            if found is not None:
                break
        self._by_type[klass] = found
        return found

    def method(self, obj: Any, name: str) -> Callable[..., Any]:
        """The bound method ``obj.name``, if the class of ``obj`` exports it."""
        entry = self._entry_of(obj)
        if entry is None or _is_dunder(name) or name not in entry.methods:
            raise NotExported(f"method {name!r} of {self.class_name(type(obj))} is not exported")
        return getattr(obj, name)

    def takes_turn(self, obj: Any, name: str) -> bool:
        """Whether a call of method ``name`` on ``obj`` waits for its turn (see
        :class:`ExportedClass`'s ``unordered``); True for anything not exported."""
        entry = self._entry_of(obj)
        return entry is None or name not in entry.unordered

    def attribute(self, obj: Any, name: str) -> Any:
        """The value of ``obj.name``, if the class of ``obj`` exports it."""
        self.check_attribute(obj, name)
        return getattr(obj, name)

    def check_attribute(self, obj: Any, name: str) -> None:
        """Raise :class:`NotExported` unless the class of ``obj`` exports ``name`` as an
        attribute (which it then does for good: the table does not change once built)."""
        entry = self._entry_of(obj)
        if entry is None or _is_dunder(name) or name not in entry.attributes:
            raise NotExported(f"attribute {name!r} of {self.class_name(type(obj))} is not exported")

    def class_name(self, klass: type) -> str:
        """The wire name of a class: its exported name, else ``module.QualName``."""
        name = self._names.get(klass)
        if name is None:
            exported = next((e.name for e in self.classes.values() if e.cls is klass), None)
            name = exported or f"{klass.__module__}.{klass.__qualname__}"
            self._names[klass] = name
        return name

    def describe(self) -> dict[str, Any]:
        """What can be reached, with signatures and first docstring lines."""

        def sig(fn: Any) -> str:
            try:
                return str(inspect.signature(fn))
            except (TypeError, ValueError):
                return "(...)"

        def summary(obj: Any) -> str:
            doc = inspect.getdoc(obj) or ""
            return doc.split("\n", 1)[0]

        return {
            "classes": {
                entry.name: {
                    "elixir_module": entry.elixir_module,
                    "constructor": sig(entry.cls) if entry.constructible else None,
                    "methods": {m: sig(getattr(entry.cls, m)) for m in entry.methods},
                    "static_methods": {m: sig(getattr(entry.cls, m)) for m in entry.static_methods},
                    "attributes": list(entry.attributes),
                    "doc": summary(entry.cls),
                }
                for entry in self.classes.values()
            },
            "functions": {
                fn.name: {"elixir_module": fn.elixir_module, "signature": sig(fn.fn)}
                for fn in self.functions.values()
            },
        }
