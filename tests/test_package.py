"""What the installed package promises: its dependencies, and what a wheel carries.

A wheel is built from this checkout (setuptools, no network, no build isolation) and read
as a zip: the wire schema (``proto/``, shipped as ``bridge_py/proto/``) and ``py.typed``
travel with the code, the worker has a console script, and protobuf is not a run-time
requirement because nothing imports it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> Requirement:
    found = [Requirement(r) for r in requires("bridge_py") or []]
    return next(r for r in found if r.name == name and r.marker is None)


def test_torch_versions_whose_weights_only_load_runs_code_are_excluded() -> None:
    # Checkpoints of other ranks are read with torch.load(weights_only=True)
    # (bridge_py.distributed.distribute.nfs), which could still run code before 2.6.
    torch = _requirement("torch")
    assert not torch.specifier.contains("2.5.1")
    assert torch.specifier.contains("2.6.0")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # Built from a copy of what the wheel is made of: setuptools writes build/ next to
    # the sources, which must not land in the checkout.
    source = tmp_path_factory.mktemp("source")
    for name in ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md"]:
        shutil.copy(ROOT / name, source / name)
    for name in ["bridge_py", "proto"]:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        timeout=170,
        cwd=source,
    )
    (path,) = out.glob("bridge_py-*.whl")
    return zipfile.ZipFile(path)


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (member,) = [n for n in wheel.namelist() if n.endswith(f".dist-info/{name}")]
    return wheel.read(member).decode()


def test_the_wheel_carries_the_wire_schema_and_the_type_marker(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    schema = sorted((ROOT / "proto").iterdir())
    assert "bridge.proto" in [path.name for path in schema]
    for path in schema:
        assert wheel.read(f"bridge_py/proto/{path.name}") == path.read_bytes()
    assert "bridge_py/py.typed" in names
    assert "bridge_py/worker/__main__.py" in names


def test_the_worker_has_a_console_script(wheel: zipfile.ZipFile) -> None:
    entry_points = _dist_info(wheel, "entry_points.txt")
    assert "vllm-bridge-worker = bridge_py.worker.__main__:main" in entry_points


def test_protobuf_is_not_a_runtime_requirement(wheel: zipfile.ZipFile) -> None:
    requires = [
        line.split(":", 1)[1].strip()
        for line in _dist_info(wheel, "METADATA").splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert any(r.startswith("grpcio") for r in requires), requires
    assert not any(r.startswith("protobuf") for r in requires), requires


def test_nothing_imports_protobuf_at_run_time() -> None:
    # Every layer a user imports, with protobuf made unimportable.
    script = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'google.protobuf' or name.startswith('google.protobuf.'):\n"
        "            raise ImportError('protobuf is not installed')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import bridge_py.distributed, bridge_py.worker.dispatcher, bridge_py.client\n"
        "import bridge_py.worker.transports.grpc, bridge_py.worker.__main__\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
