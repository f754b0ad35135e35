"""The description of the Elixir modules to generate: modules, functions, parameters.

Plain data, filled in by ``build`` (from the export table and the Python signatures and
docstrings) and read by ``references`` and ``render``; see ``build`` for the conventions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["constructor", "method", "static", "function", "getter"]
Where = Literal["positional", "args", "named", "opts"]


@dataclass
class Param:
    """One Python parameter as the Elixir function exposes it."""

    name: str
    var: str
    spec: str
    where: Where
    default: str | None = None  # Markdown: an Elixir term in backticks, or words
    doc: str = ""  # Markdown, from the docstring's ``Args:`` entry


@dataclass
class Function:
    """One generated Elixir function."""

    name: str
    kind: Kind
    target: str  # the wire name: class, method, "Class.static" or function
    params: list[Param]
    returns: str
    python_doc: str  # the docstring as Python has it ("" when there is none)
    fallback: str  # the doc when the docstring is empty or all implementation notes
    origin: object = None  # the Python object documented (for the docs audit)
    doc: str = ""  # Markdown, once built
    returns_doc: str | None = None
    errors: tuple[tuple[str, str], ...] = ()
    # False when the shorter arities belong to another function of the same name: then
    # ``args`` and ``opts`` have no defaults (see ``build``).
    defaults: bool = True

    @property
    def positional(self) -> list[Param]:
        """Parameters that are positional Elixir parameters."""
        return [p for p in self.params if p.where == "positional"]

    @property
    def has_args(self) -> bool:
        """Whether the function takes a trailing ``args`` list."""
        return any(p.where in ("args", "named") for p in self.params)

    @property
    def named(self) -> list[Param]:
        """Optional positional Python parameters that Elixir gives by name only: from the
        first that may be a list on (a list there would read as the ``args`` list)."""
        return [p for p in self.params if p.where == "named"]

    @property
    def takes_ref(self) -> bool:
        """Whether the first Elixir parameter is a ref."""
        return self.kind in ("method", "static", "getter")

    @property
    def arity(self) -> int:
        """The Elixir arity, ``opts`` included (what a doc's ``name/arity`` names)."""
        return int(self.takes_ref) + len(self.positional) + int(self.has_args) + 1

    @property
    def arities(self) -> range:
        """Every Elixir arity the function is defined at (several with defaults)."""
        least = self.arity - int(self.has_args) - 1 if self.defaults else self.arity
        return range(least, self.arity + 1)

    @property
    def python_name(self) -> str:
        """The member name in Python (``__init__`` for ``new``; a method's own name for an
        alias, which calls it under another name)."""
        if self.kind == "constructor":
            return "__init__"
        return self.target if self.kind == "method" else self.name


@dataclass
class Module:
    """One generated Elixir module (and file)."""

    name: str
    python_doc: str
    fallback: str
    python_name: str
    is_class: bool
    functions: list[Function] = field(default_factory=list)
    origin: object = None  # the class, or the Python module of a functions module
    moduledoc: str = ""  # Markdown, once built

    @property
    def path(self) -> str:
        """The file path under ``elixir/lib``, as Elixir's Macro.underscore names it."""
        return "/".join(underscore(part) for part in self.name.split(".")) + ".ex"


def underscore(name: str) -> str:
    """``StatelessProcessGroup -> stateless_process_group``, ``NFSWorkspace -> nfs_workspace``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
