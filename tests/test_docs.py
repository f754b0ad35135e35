"""Every Python snippet of README.md and docs/ runs, so the docs cannot rot.

A ```` ```python ```` block runs as a script in a fresh interpreter (this checkout on its
path, a scratch directory as its working directory), once, or as several ranks when
the line before its fence says so:

    <!-- run: ranks=3 -->   three processes, with RANK=0, 1, 2 in their environment
    <!-- run: grpc -->      with two real workers serving gRPC (below)

Snippets show what users type, so the runner adapts only what differs per machine:

* the ports 29500-29599 become free ports (one per distinct port in the snippet);
* under ``grpc``, ``"host:50051"`` and ``"10.0.0.1:50051"`` name a worker on a loopback
  TCP port whose token is ``token="..."`` (and the contents of ``"/path/to/token"``),
  and ``"unix:/run/user/1000/bridge.sock"`` names a worker on a Unix socket.

A snippet passes when every process exits with status 0 (their ``assert``\\ s are the
documented results) within the time limit; the processes are killed otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.harness import free_port
from tests.grpc.conftest import GrpcWorker

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT = 120  # seconds for all the processes of one snippet

_DIRECTIVE = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
_PORT = re.compile(r"\b295\d\d\b")


@dataclass(frozen=True)
class Snippet:
    """One ```` ```python ```` block: where it is, its code, and how it runs."""

    path: Path
    line: int
    code: str
    ranks: int = 1
    grpc: bool = False

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _parse_directive(text: str, where: str) -> dict:
    options: dict = {}
    for word in text.split():
        if word == "grpc":
            options["grpc"] = True
        elif word.startswith("ranks="):
            options["ranks"] = int(word.removeprefix("ranks="))
        else:
            raise ValueError(f"{where}: unknown run option {word!r}")
    return options


def snippets(path: Path) -> Iterator[Snippet]:
    """The Python blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        start = index + 1
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        found = _DIRECTIVE.search(before)
        where = f"{path.relative_to(ROOT)}:{start}"
        options = _parse_directive(found.group(1), where) if found else {}
        yield Snippet(path, start, "\n".join(lines[start:end]) + "\n", **options)
        index = end + 1


ALL = [snippet for path in DOCS for snippet in snippets(path)]


def _with_free_ports(code: str) -> str:
    ports: dict[str, str] = {}
    return _PORT.sub(lambda m: ports.setdefault(m.group(0), str(free_port())), code)


def _run(snippet: Snippet, code: str, scratch: Path) -> None:
    script = scratch / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(snippet.ranks)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=scratch,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(snippet.ranks)
    ]
    failures = []
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=LIMIT)
            if proc.returncode != 0:
                failures.append(f"rank {rank} exited with {proc.returncode}:\n{out.decode()}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not failures, f"{snippet.name}\n{code}\n" + "\n".join(failures)


@pytest.mark.timeout(LIMIT + 60)
@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet: Snippet) -> None:
    code = _with_free_ports(snippet.code)
    with tempfile.TemporaryDirectory() as scratch:
        if not snippet.grpc:
            _run(snippet, code, Path(scratch))
            return
        socket = Path(scratch) / "bridge.sock"
        tcp = GrpcWorker(exports=None)
        uds = GrpcWorker("--grpc", f"unix:{socket}", exports=None, token_env=False)
        try:
            token_file = Path(scratch) / "token"
            token_file.write_text(tcp.token or "")
            token_file.chmod(0o600)
            for address in ['"host:50051"', '"10.0.0.1:50051"']:
                code = code.replace(address, f'"{tcp.target}"')
            code = code.replace('"unix:/run/user/1000/bridge.sock"', f'"{uds.target}"')
            code = code.replace('token="..."', f'token="{tcp.token}"')
            code = code.replace('"/path/to/token"', f'"{token_file}"')
            _run(snippet, code, Path(scratch))
        finally:
            tcp.stop()
            uds.stop()


def test_every_python_block_is_found() -> None:
    # The parser must not miss blocks (a miss would be a snippet nobody runs).
    fences = sum(p.read_text().count("```python") for p in DOCS)
    assert len(ALL) == fences >= 6
