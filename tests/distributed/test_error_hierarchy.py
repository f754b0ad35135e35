"""Errors of bridge_py.distributed come from its one hierarchy (``errors.py``).

A bare ``raise RuntimeError(...)`` can only be caught by its message; every failure of the
package is a class of ``errors.py`` (each a RuntimeError, as what vLLM raises), or one of
Python's own argument errors (ValueError, TypeError, ...) for a bad argument.
"""

from __future__ import annotations

import ast
from pathlib import Path

from bridge_py.distributed import errors

PACKAGE = Path(__file__).resolve().parents[2] / "bridge_py" / "distributed"


def _bare_raises(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name) and func.id in ("RuntimeError", "Exception"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raises {func.id}")
    return found


def test_no_bare_runtime_error_is_raised() -> None:
    bare = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _bare_raises(path)]
    assert not bare, "\n".join(bare)


def test_every_error_of_the_hierarchy_is_a_runtime_error() -> None:
    classes = [getattr(errors, name) for name in errors.__all__ if name[0].isupper()]
    assert classes and all(issubclass(cls, errors.DistributedError) for cls in classes)
    assert issubclass(errors.DistributedError, RuntimeError)
    assert issubclass(errors.GroupTimeout, TimeoutError)
    assert str(errors.WaitCancelled("cancelled")) == "cancelled"


def test_the_whole_hierarchy_is_exported_by_the_package_and_in_the_guide() -> None:
    import bridge_py.distributed as package

    classes = [name for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    assert "DistributedError" in classes and len(classes) >= 14
    guide = (PACKAGE.parents[1] / "docs" / "guide-python.md").read_text()
    for name in classes:
        assert getattr(package, name, None) is getattr(errors, name), name
        assert name in package.__all__, name
        assert f"`{name}`" in guide, f"{name} is not in the guide's table"
