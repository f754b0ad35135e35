"""The worker's command line names itself the way it was started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).parent / "vllm-bridge-worker"


def _usage(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.splitlines()[0]


def test_the_installed_command_names_itself_in_its_help() -> None:
    if not COMMAND.exists():
        pytest.skip(f"the package's command is not installed beside {sys.executable}")
    assert _usage([str(COMMAND), "--help"]).startswith("usage: vllm-bridge-worker ")


def test_the_module_names_itself_in_its_help() -> None:
    usage = _usage([sys.executable, "-m", "bridge_py.worker", "--help"])
    assert usage.startswith("usage: python -m bridge_py.worker ")
