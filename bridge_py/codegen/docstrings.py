"""Python docstrings (the project's reST-ish dialect) -> the Markdown ExDoc renders.

What an Elixir user reads is what a function does and promises, in Markdown:

* ``:meth:`x```-style roles (``:attr:``, ``:class:``, ``:func:``, ``:meth:``,
  ``:data:``, ``:exc:``, ``:mod:``, ``:obj:``, with ``~``, ``!``, dotted paths or an
  explicit ``title <target>``) become inline code naming what an Elixir user knows:
  the caller's ``resolve`` maps exported objects to Elixir modules and functions;
  anything else becomes the target's last dotted component;
* ``double backtick`` literals become single-backtick inline code;
* a paragraph ending in ``::`` keeps its text (``Example::`` -> ``Example:``) and the
  indented literal block after it becomes a fenced code block, as do ``>>>`` doctest
  paragraphs and ``.. code-block::`` directives; ``.. note::``-style admonitions
  become block quotes; other directives are refused (:class:`DocstringError`);
* Google-style sections (``Args:``, ``Returns:``, ``Raises:``) are parsed: their
  entries can be lifted out (to sit beside the generated parameter and return types)
  or are rendered in place as Markdown lists;
* a line that starts with ``NOTE:`` inside a paragraph starts a paragraph of its own;
* implementation notes are left out: a paragraph that begins with ``Implementation:``,
  with the more indented lines that follow it, is omitted (:func:`kept_lines`).

Bullet and numbered lists, emphasis and single-backtick code read the same in both
dialects and are kept as written, line breaks included, so that a docstring's first
line stays its summary and the output changes only where the docstring does.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

# (role, target) -> Markdown inline code naming an exported object, or None when the
# target is not exported (the converter then shows the target's last component).
Resolver = Callable[[str, str], str | None]

IMPLEMENTATION_MARKER = "Implementation:"

_ROLE = re.compile(r":(?:[a-z]+:)?([a-z][a-z-]*):`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_LINK = re.compile(r"`([^`<]+?)\s*<([^>`]+)>`__?")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w-]+)::\s*(.*)$")
_COMMENT = re.compile(r"^\s*\.\.(\s|$)")
_SECTION = re.compile(r"^\s*([A-Z][a-z]+(?: [A-Z]?[a-z]+)?):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)\s*(?:\(([^)]*)\))?\s*:(?:\s+(.*))?$")
_NOTE = re.compile(r"^\s*NOTE:")

_ARGS_SECTIONS = {
    "Args",
    "Arguments",
    "Parameters",
    "Params",
    "Keyword Args",
    "Keyword Arguments",
    "Other Parameters",
}
_RETURNS_SECTIONS = {"Returns", "Return", "Yields"}
_RAISES_SECTIONS = {"Raises", "Raise"}
_CODE_DIRECTIVES = {"code-block", "code", "sourcecode"}
_ADMONITIONS = {
    "note": "Note",
    "warning": "Warning",
    "tip": "Tip",
    "hint": "Hint",
    "important": "Important",
    "attention": "Attention",
    "caution": "Caution",
    "danger": "Danger",
    "error": "Error",
    "seealso": "See also",
    "deprecated": "Deprecated",
    "versionadded": "Added in version",
    "versionchanged": "Changed in version",
}


class DocstringError(ValueError):
    """A docstring construct the converter cannot render as Markdown faithfully."""


@dataclass(frozen=True)
class Converted:
    """A docstring as Markdown, with the Google-style entries that were lifted out.

    ``params`` maps a parameter named in an ``Args:`` section to its description
    (only names the caller asked to lift); ``returns`` is the ``Returns:`` text and
    ``raises`` the ``Raises:`` entries, both only when the caller lifts results.
    """

    text: str
    params: dict[str, str] = field(default_factory=dict)
    returns: str | None = None
    raises: tuple[tuple[str, str], ...] = ()


def _no_resolver(role: str, target: str) -> str | None:
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The end of the block from ``start`` whose lines are indented past ``indent``.

    Blank lines inside the block belong to it; trailing blank lines do not.
    """
    end = start
    j = start
    while j < len(lines):
        if lines[j].strip():
            if _indent(lines[j]) <= indent:
                break
            end = j + 1
        j += 1
    return end


def kept_lines(doc: str) -> list[tuple[int, str]]:
    """The lines of ``doc`` that reach the Elixir docs, with their line index in ``doc``.

    A paragraph (after a blank line, or at the start) whose first line begins with
    ``Implementation:`` is dropped, with every following line indented more than it
    (so a Google-style ``Implementation:`` section with an indented body goes too).
    """
    lines = doc.splitlines()
    kept: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        starts_paragraph = i == 0 or not lines[i - 1].strip()
        if starts_paragraph and line.lstrip().startswith(IMPLEMENTATION_MARKER):
            indent = _indent(line)
            j = i + 1
            while j < len(lines) and lines[j].strip():
                j += 1
            i = max(j, _block_end(lines, j, indent))
            # One blank line separated what was dropped from what came before.
            while i < len(lines) and not lines[i].strip():
                i += 1
            continue
        kept.append((i, line))
        i += 1
    while kept and not kept[-1][1].strip():
        kept.pop()
    return kept


def _role(match: re.Match[str], resolve: Resolver) -> str:
    role, content = match.group(1), match.group(2).strip()
    title = None
    explicit = re.fullmatch(r"(.+?)\s*<([^>]+)>", content)
    if explicit:
        title, content = explicit.group(1), explicit.group(2)
    target = content.lstrip("~!").strip()
    if target.endswith("()"):
        target = target[:-2]
    resolved = resolve(role, target)
    if resolved is not None:
        return resolved
    shown = title if title is not None else target.rsplit(".", 1)[-1]
    return f"`{shown}`"


def _literal(match: re.Match[str]) -> str:
    content = match.group(1)
    if "`" in content:
        raise DocstringError(
            f"the literal ``{content}`` contains a backtick, which Markdown inline code "
            "can only hold between double backticks: rephrase it"
        )
    return f"`{content}`"


def inline(text: str, resolve: Resolver = _no_resolver) -> str:
    """Roles, ``double backtick`` literals and `links <url>`_ of ``text`` as Markdown."""
    if "`" not in text:
        return text
    text = _ROLE.sub(lambda m: _role(m, resolve), text)
    text = _LITERAL.sub(_literal, text)
    return _LINK.sub(lambda m: f"[{m.group(1)}]({m.group(2)})", text)


def _fence(lines: list[str], language: str = "") -> list[str]:
    body = textwrap.dedent("\n".join(lines)).strip("\n").splitlines()
    fence = "```"
    while any(line.lstrip().startswith(fence) for line in body):
        fence += "`"
    return [fence + language, *body, fence]


def _literal_marker(line: str) -> str | None:
    """A paragraph's last line without its ``::`` marker; None if nothing is left."""
    stripped = line.rstrip()
    if stripped.strip() == "::":
        return None
    if stripped[-3:-2].isspace():
        return stripped[:-2].rstrip()
    return stripped[:-1]


def _entries(body: list[str]) -> list[tuple[str, list[str]]] | None:
    """``name: description`` entries of a section body (dedented); None if it has none."""
    entries: list[tuple[str, list[str]]] = []
    for line in body:
        if not line.strip():
            if entries:
                entries[-1][1].append("")
            continue
        if _indent(line) == 0:
            match = _ENTRY.match(line)
            if match is None:
                return None
            entries.append((match.group(1).lstrip("*"), [match.group(3) or ""]))
        elif entries:
            entries[-1][1].append(line.strip())
        else:
            return None
    return entries


def _description(lines: list[str], resolve: Resolver) -> str:
    """An entry's description: one Markdown paragraph (its lines, unindented)."""
    return inline("\n".join(line for line in lines if line.strip()), resolve)


def _entry_list(entries: list[tuple[str, str]]) -> list[str]:
    """Entries as a Markdown list, descriptions after a dash and indented under it."""
    out = []
    for name, desc in entries:
        first, *rest = desc.split("\n")
        out.append(f"  * `{name}` - {first}" if first else f"  * `{name}`")
        out += [f"    {line}" for line in rest]
    return out


class _Converter:
    """One docstring's conversion; ``out`` collects Markdown lines."""

    def __init__(self, resolve: Resolver, params: Collection[str], results: bool) -> None:
        self.resolve = resolve
        self.params = params
        self.results = results
        self.lifted: dict[str, str] = {}
        self.returns: list[str] = []
        self.raises: list[tuple[str, str]] = []

    def convert(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                out.append("")
                i += 1
                continue
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            indent = _indent(line)
            if _DIRECTIVE.match(line):
                body_end = _block_end(lines, i + 1, indent)
                out += self._directive(line, lines[i + 1 : body_end])
                i = body_end
                continue
            if _COMMENT.match(line):
                i = max(end, _block_end(lines, i + 1, indent))
                continue
            section = _SECTION.match(line)
            if section and i + 1 < len(lines) and _indent(lines[i + 1]) > indent:
                body_end = _block_end(lines, i + 1, indent)
                body = textwrap.dedent("\n".join(lines[i + 1 : body_end])).splitlines()
                out += self._section(line[:indent], section.group(1), body)
                i = body_end
                continue
            if line.lstrip().startswith(">>>"):
                out += _fence(lines[i:end], "python")
                i = end
                continue
            paragraph = lines[i:end]
            if paragraph[-1].rstrip().endswith("::"):
                last = _literal_marker(paragraph[-1])
                paragraph = paragraph[:-1] + ([last] if last is not None else [])
                block = end
                while block < len(lines) and not lines[block].strip():
                    block += 1
                if block < len(lines) and _indent(lines[block]) > indent:
                    block_end = _block_end(lines, block, indent)
                    if paragraph:
                        out += [*self._paragraph(paragraph), ""]
                    out += _fence(lines[block:block_end])
                    i = block_end
                    continue
            out += self._paragraph(paragraph)
            i = end
        return out

    def _paragraph(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for n, line in enumerate(lines):
            if n > 0 and _NOTE.match(line):
                out.append("")
            out.append(line)
        return inline("\n".join(out), self.resolve).split("\n")

    def _directive(self, line: str, body: list[str]) -> list[str]:
        match = _DIRECTIVE.match(line)
        assert match is not None
        margin, name, argument = match.group(1), match.group(2), match.group(3).strip()
        if name in _CODE_DIRECTIVES:
            return [margin + part for part in _fence(body, argument)]
        if name not in _ADMONITIONS:
            known = ", ".join(sorted([*_ADMONITIONS, *_CODE_DIRECTIVES]))
            raise DocstringError(
                f"the directive '.. {name}::' has no Markdown rendering: "
                f"use a plain paragraph, or one of {known}"
            )
        text = self.convert(textwrap.dedent("\n".join(body)).splitlines())
        label = _ADMONITIONS[name]
        head = f"**{label}{' ' + argument if argument and name.startswith('version') else ''}:**"
        if argument and not name.startswith("version"):
            text = [inline(argument, self.resolve), *text]
        while text and not text[-1].strip():
            text.pop()
        if text:
            text[0] = f"{head} {text[0]}"
        else:
            text = [head]
        return [f"{margin}> {t}".rstrip() for t in text]

    def _section(self, margin: str, title: str, body: list[str]) -> list[str]:
        if title in _ARGS_SECTIONS or (title in _RAISES_SECTIONS and not self.results):
            entries = _entries(body)
            if entries is not None:
                kept = []
                for name, desc in entries:
                    text = _description(desc, self.resolve)
                    if name in self.params and title in _ARGS_SECTIONS:
                        self.lifted[name] = text
                    else:
                        kept.append((name, text))
                if not kept:
                    return []
                return [margin + line for line in [f"{title}:", "", *_entry_list(kept)]]
        if title in _RAISES_SECTIONS and self.results:
            entries = _entries(body)
            if entries is not None:
                for name, desc in entries:
                    self.raises.append((name.rsplit(".", 1)[-1], _description(desc, self.resolve)))
                return []
        if title in _RETURNS_SECTIONS and self.results:
            self.returns.append("\n".join(self.convert(body)).strip())
            return []
        converted = self.convert(body)
        return [margin + line if line else "" for line in [f"{title}:", "", *converted]]


def to_markdown(
    doc: str,
    resolve: Resolver = _no_resolver,
    *,
    params: Collection[str] = (),
    results: bool = False,
) -> Converted:
    """``doc`` (as :func:`inspect.getdoc` returns it) as ExDoc Markdown.

    ``params`` names the parameters whose ``Args:`` entries are lifted into
    ``Converted.params`` (the others stay in the text); with ``results`` the
    ``Returns:`` and ``Raises:`` sections are lifted too. Raises
    :class:`DocstringError` on a construct with no faithful Markdown rendering.
    """
    converter = _Converter(resolve, params, results)
    lines = converter.convert([line for _, line in kept_lines(doc)])
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in lines)).strip()
    returns = "\n\n".join(r for r in converter.returns if r) or None
    return Converted(text, converter.lifted, returns, tuple(converter.raises))
