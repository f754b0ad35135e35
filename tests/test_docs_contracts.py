"""Docs that are contracts: no docstring or module doc quotes a measurement.

A docstring (every module, class and function of bridge_py) and an Elixir ``@moduledoc``,
``@doc`` or ``@typedoc`` (elixir/lib, the generated modules included) say what a caller
may rely on. What a benchmark found on some machine (a time, a rate, a ratio) is no
such promise: it goes stale with the next change and the next machine, so it belongs
in bench/README.md ("Where the time goes today") and bench/RESULTS.md, or in git.

The rule, applied to each sentence of each doc:

* a ratio (``0.86x``, ``4x``) or a percentage is a measurement;
* so is a time or a rate (``10 us``, ``2 ms``, ``30 s``, ``32 MiB/s``) in a sentence
  that reports a finding (``measured``, ``took``, ``faster``, ``~``, ``on OTP 25``, ...,
  see ``_FINDING``);
* any other time or rate is allowed only when its sentence says what the code
  guarantees: a default, a bound (``at most``, ``at least``, ``up to``, ``within``), a
  timeout, a deadline, a period (``every``), see ``_CONTRACT``.

``ALLOWED`` lists the few sentences that break the rule and are contracts all the same,
each with its reason.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:\s*(?:-|to)\s*\d[\d,]*(?:\.\d+)?)?"
_TIME = re.compile(
    _NUMBER + r"\s*(?:ns|us|µs|ms|s|sec|secs|seconds?|minutes?|min|hours?)\b", re.IGNORECASE
)
_RATE = re.compile(
    _NUMBER + r"\s*(?:[KMG]i?B|B|bytes|calls|ops|messages|frames)?\s*(?:/s|per second)\b"
)
_RATIO = re.compile(r"(?<![\w.])(?!0x)\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?x\b")
_TIMES = re.compile(r"\b(?:\d+|two|three|four|five|ten|several|many)\s+times\s+(?:faster|slower)\b")
_PERCENT = re.compile(_NUMBER + r"\s*%")
# A spread of times ("25-85 us", "6 to 8 s") is what a run saw, never what code promises.
_SPREAD = re.compile(r"\d(?:\s*-\s*|\s+to\s+)\d")

# Words that make a sentence report what was seen, not what the code does.
_FINDING = re.compile(
    r"\bmeasured\b|\bmeasurements?\b|\btook\b|\bfaster\b|\bslower\b|\bseen\b|\bsaw\b|~|"
    r"\babout\b|\broughly\b|\btypically\b|\bbenchmarks?\b|\bbench/|\bOTP \d|"
    r"\b(?:on|of) (?:a|this|one|two|four|\d+)[\w\s-]{0,20}\b(?:VM|machine|CPUs?|cores?|laptop)\b|"
    r"\bXeon\b|\bEPYC\b|\bRyzen\b|\bcosts?\b|\bsaves?\b",
    re.IGNORECASE,
)
# Words that make a sentence say what the code guarantees.
_CONTRACT = re.compile(
    r"\bdefault\b|\bat most\b|\bat least\b|\bup to\b|\bwithin\b|\blimit\b|\btimeouts?\b|"
    r"\bdeadlines?\b|\bevery\b|\bafter\b|\bwaits?\b|\bgives? up\b|\bbound(?:ed|s)?\b|"
    r"\bper\b|\bkeepalive\b",
    re.IGNORECASE,
)

# Sentences the rule flags that are contracts all the same: (a phrase of the sentence,
# why it is a promise rather than a finding). None today: rewording a contract so that
# it says what is guaranteed ("at most", "default") is better than an entry here.
ALLOWED: list[tuple[str, str]] = []

_SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z`(*\"'])|\n\s*\n|\n\s*[*-]\s")


@dataclass(frozen=True)
class Doc:
    """One doc: where it is, and its text."""

    where: str
    text: str


@dataclass(frozen=True)
class Finding:
    where: str
    figure: str
    sentence: str

    def __str__(self) -> str:
        return f"{self.where}: {self.figure!r} in: {self.sentence}"


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences (and list items), each on one line."""
    return [" ".join(part.split()) for part in _SENTENCE_END.split(text) if part.strip()]


def measurements(text: str) -> list[tuple[str, str]]:
    """``(figure, sentence)`` for every measurement quoted in ``text`` (see the module doc)."""
    found = []
    for sentence in sentences(text):
        if any(phrase in sentence for phrase, _ in ALLOWED):
            continue
        # Figures inside code (`...`) are values, not claims: `timeout: 5000`.
        prose = re.sub(r"`[^`]*`", "``", sentence)
        for pattern in (_RATIO, _TIMES, _PERCENT):
            found += [(match.group(0), sentence) for match in pattern.finditer(prose)]
        timed = [m.group(0) for p in (_TIME, _RATE) for m in p.finditer(prose)]
        spread = any(_SPREAD.search(figure) for figure in timed)
        if timed and (spread or _FINDING.search(prose) or not _CONTRACT.search(sentence)):
            found += [(figure, sentence) for figure in timed]
    return found


def python_docs(path: Path, root: Path = ROOT) -> Iterator[Doc]:
    """The docstrings of one Python file: its module's, and every class's and function's."""
    tree = ast.parse(path.read_text(), str(path))
    name = str(path.relative_to(root))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                line = getattr(node, "lineno", 1)
                yield Doc(f"{name}:{line}", text)


_HEREDOC = re.compile(r'^\s*@(moduledoc|doc|typedoc)\s+(?:~[sS])?"""\s*$')
_ONE_LINE = re.compile(r'^\s*@(moduledoc|doc|typedoc)\s+(?:~[sS])?"((?:[^"\\]|\\.)*)"\s*$')


def elixir_docs(path: Path, root: Path = ROOT) -> Iterator[Doc]:
    """The ``@moduledoc``, ``@doc`` and ``@typedoc`` texts of one Elixir file."""
    lines = path.read_text().splitlines()
    name = str(path.relative_to(root))
    index = 0
    while index < len(lines):
        line = lines[index]
        if one := _ONE_LINE.match(line):
            yield Doc(f"{name}:{index + 1}", one.group(2))
        elif _HEREDOC.match(line):
            start = index
            body = []
            index += 1
            while index < len(lines) and lines[index].strip() != '"""':
                body.append(lines[index])
                index += 1
            yield Doc(f"{name}:{start + 1}", "\n".join(body))
        index += 1


def all_docs() -> Iterator[Doc]:
    for path in sorted((ROOT / "bridge_py").rglob("*.py")):
        yield from python_docs(path)
    for path in sorted((ROOT / "elixir" / "lib").rglob("*.ex")):
        yield from elixir_docs(path)


def findings(docs: Iterator[Doc]) -> list[Finding]:
    return [
        Finding(doc.where, figure, sentence)
        for doc in docs
        for figure, sentence in measurements(doc.text)
    ]


def test_no_doc_quotes_a_measurement() -> None:
    found = findings(all_docs())
    assert not found, (
        "docs quote measurements; move them to bench/README.md, or say what the code "
        "guarantees:\n" + "\n".join(map(str, found))
    )


def test_the_docs_are_read() -> None:
    docs = list(all_docs())
    where = {doc.where.split(":")[0] for doc in docs}
    assert "elixir/lib/vllm_bridge/worker.ex" in where
    assert "bridge_py/worker/transports/spin_policy.py" in where
    assert len(docs) > 500


@pytest.mark.parametrize(
    "text",
    [
        "Measured on OTP 25, a late reply reaches its caller about 10 us later.",
        "With four callers on two CPUs, callers that looked made 0.86x of the calls.",
        "The worker is 1.10-1.22x slower than one that always spins.",
        "An idle queue costs about 1% of a core.",
        "A wake-up costs 50-150 us on a virtual machine.",
        "Encoding 1 GiB takes ~20 s.",
        "Decoding runs at 32 MiB/s.",
        "A 5 s timeout took 6 to 8 s.",
        "Copying is several times slower there.",
        "The reply lands 2 to 28 ms after the wait gave up.",
    ],
)
def test_a_measurement_is_caught(text: str) -> None:
    assert measurements(text), text


@pytest.mark.parametrize(
    "text",
    [
        "Waits at most 30 s for the store.",
        "The back-off starts at 500 ms (default) and doubles.",
        "Every 5000 ms the worker checks for silence.",
        "`shutdown/2` ends every wait within 10 ms.",
        "Raise `timeout: 120_000` for long calls.",
        "The `:health_timeout` option (ms, default 5000).",
        "A ping gets 1 s more per 32 MiB written to Python.",
        "Reads the header, a struct of format `2xIQ16s`.",
        "A truncated value (type byte 0x#{hex(byte)}).",
    ],
)
def test_a_contract_passes(text: str) -> None:
    assert not measurements(text), measurements(text)


def test_a_measurement_in_a_file_is_caught(tmp_path: Path) -> None:
    python = tmp_path / "sample.py"
    python.write_text(
        '"""A module."""\n\n\ndef f():\n    """Returns fast: 3 us per call, measured."""\n'
    )
    elixir = tmp_path / "sample.ex"
    elixir.write_text(
        'defmodule Sample do\n  @moduledoc """\n  A caller waits at most 50 us.\n\n'
        '  With the gate, 0.88-0.98x of the calls.\n  """\n\n'
        '  @doc "Took 7 ms on a small VM."\n  def f, do: :ok\nend\n'
    )
    found = findings(iter([*python_docs(python, tmp_path), *elixir_docs(elixir, tmp_path)]))
    assert [(f.where, f.figure) for f in found] == [
        ("sample.py:4", "3 us"),
        ("sample.ex:2", "0.88-0.98x"),
        ("sample.ex:8", "7 ms"),
    ]
