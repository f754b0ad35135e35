"""Python names in docstrings -> the Elixir names the generated modules give them.

A docstring's ``:meth:`create_from_handle``` means, to an Elixir user,
``Vllm.Distributed.MessageQueue.create_from_handle/4``; this module answers such
questions for one generated module at a time (the *context*), from the modules
being generated (so only exported objects resolve):

* ``Class`` or ``package.module.Class`` -> the class's Elixir module;
* ``Class.member`` -> that module's function (``__init__`` is ``new``);
* a bare ``member`` -> a function of the context module, else a generated module
  function (``Vllm.Distributed.init_distributed_environment/2``), else the one
  exported class member of that name, if exactly one class has it;
* ``package.module.function`` -> the generated module function of that name.

A name in the context module is written ``name/arity`` (ExDoc links it within the
module), any other ``Module.name/arity``. Anything else does not resolve (None): the
caller shows the Python name's last component as plain code.
"""

from __future__ import annotations

from collections.abc import Iterable

from bridge_py.codegen.docstrings import Resolver
from bridge_py.codegen.model import Function, Module


class References:
    """An index of the generated modules' Python names."""

    def __init__(self, modules: Iterable[Module]) -> None:
        self._classes: dict[str, Module] = {}
        self._functions: dict[str, tuple[Module, Function]] = {}
        self._members: dict[str, list[tuple[Module, Function]]] = {}
        for module in modules:
            if module.is_class:
                self._classes[module.python_name] = module
                origin = module.origin
                if isinstance(origin, type):
                    self._classes.setdefault(origin.__qualname__, module)
                for fn in module.functions:
                    self._members.setdefault(fn.python_name, []).append((module, fn))
            else:
                for fn in module.functions:
                    self._functions.setdefault(fn.name, (module, fn))

    def resolver(self, context: Module) -> Resolver:
        """Resolves names as written in the docs of ``context``."""

        def resolve(role: str, target: str) -> str | None:
            return self.resolve(context, target)

        return resolve

    def resolve(self, context: Module, target: str) -> str | None:
        """The Markdown inline code for ``target`` read in ``context``, or None."""
        parts = [part for part in target.split(".") if part]
        if not parts:
            return None
        last = parts[-1]
        if len(parts) >= 2 and parts[-2] not in ("self", "cls"):
            owner = self._classes.get(parts[-2])
            if owner is not None:
                return self._member(context, owner, last)
            if parts[-2][:1].isupper():
                return None  # a member of a class that is not exported
        if last in self._classes:
            return f"`{self._classes[last].name}`"
        if context.is_class and (len(parts) == 1 or parts[0] in ("self", "cls")):
            local = self._member(context, context, last)
            if local is not None:
                return local
        if last in self._functions:
            module, fn = self._functions[last]
            return self._written(context, module, fn)
        candidates = self._members.get(last, [])
        if len(parts) == 1 and len(candidates) == 1:
            module, fn = candidates[0]
            return self._written(context, module, fn)
        return None

    def _member(self, context: Module, owner: Module, name: str) -> str | None:
        fn = next((f for f in owner.functions if f.python_name == name), None)
        return None if fn is None else self._written(context, owner, fn)

    @staticmethod
    def _written(context: Module, module: Module, fn: Function) -> str:
        if module is context:
            return f"`{fn.name}/{fn.arity}`"
        return f"`{module.name}.{fn.name}/{fn.arity}`"
