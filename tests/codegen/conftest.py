"""A copy of what the code generator reads and writes, for --check --root tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bridge_py.codegen import schema

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout holding only the schema (``proto/``) and the generated files."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "proto", root / "proto")
    shutil.copytree(ROOT / "elixir" / "lib" / "vllm", root / "elixir" / "lib" / "vllm")
    for rel in (schema.PYTHON_PATH, schema.ELIXIR_PATH):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    return root
