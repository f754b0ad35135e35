"""What the installed package promises about its dependencies."""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement


def _requirement(name: str) -> Requirement:
    found = [Requirement(r) for r in requires("bridge_py") or []]
    return next(r for r in found if r.name == name and r.marker is None)


def test_torch_versions_whose_weights_only_load_runs_code_are_excluded() -> None:
    # Checkpoints of other ranks are read with torch.load(weights_only=True)
    # (bridge_py.distributed.distribute.nfs), which could still run code before 2.6.
    torch = _requirement("torch")
    assert not torch.specifier.contains("2.5.1")
    assert torch.specifier.contains("2.6.0")
