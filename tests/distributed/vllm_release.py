"""vLLM's own StatelessProcessGroup and ncclUniqueId, taken from its released wheels.

Compatibility is tested against vLLM's code, not a re-implementation of it. The wheel of a
release is downloaded once (``pip download --no-deps``) into a cache outside the repository
(``$VLLM_BRIDGE_WHEEL_CACHE``, default ``~/.cache/vllm_bridge/wheels``); nothing of vLLM is
committed. Importing ``vllm`` itself would need its whole dependency set (zmq, psutil, its
platforms), so :func:`install` runs just the definitions the tests need, as the wheel ships
them, in modules registered under vLLM's own paths (a pickle then names them as a vLLM rank's
would): from ``vllm/distributed/utils.py`` the class ``StatelessProcessGroup`` with
``create_tcp_store`` and ``sched_yield``, which it calls, and from
``vllm/distributed/device_communicators/pynccl_wrapper.py`` the class ``ncclUniqueId``.

A wheel that cannot be had fails the test that needs it, with pip's reason: these tests
must not pass by being skipped.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

__all__ = ["VERSIONS", "install", "wheel"]

VERSIONS = ("0.33.0", "0.34.0")
_UTILS = "vllm/distributed/utils.py"
_NCCL = "vllm/distributed/device_communicators/pynccl_wrapper.py"
_TAKE = {
    _UTILS: {"USE_SCHED_YIELD", "sched_yield", "create_tcp_store", "StatelessProcessGroup"},
    _NCCL: {"ncclUniqueId", "NCCL_UNIQUE_ID_BYTES"},
}


def _cache() -> Path:
    default = Path.home() / ".cache" / "vllm_bridge" / "wheels"
    return Path(os.environ.get("VLLM_BRIDGE_WHEEL_CACHE", default))


def wheel(version: str) -> Path:
    """The path of vLLM ``version``'s wheel, downloaded into the cache if it is not there.

    Raises RuntimeError with pip's output when it cannot be downloaded."""
    cache = _cache()
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
        [*command, "--dest", str(cache), f"vllm=={version}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download vLLM {version}'s wheel into {cache} (the vLLM-wire tests "
            f"run against it): pip exited {done.returncode}: {done.stderr[-2000:]}"
        )
    return found[0]


def _definitions(source: str, names: set[str], path: str) -> str:
    """The imports of ``source`` that need no vLLM, and its top-level definitions of
    ``names`` (each must be there), as source text."""
    tree = ast.parse(source)
    kept: list[ast.stmt] = []
    seen: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            if all(alias.name.split(".")[0] != "vllm" for alias in node.names):
                kept.append(node)
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] != "vllm":
                kept.append(node)
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            kept.append(node)
            seen.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if targets & names:
                kept.append(node)
                seen |= targets & names
    missing = names - seen
    assert not missing, f"{path} of this wheel defines no {sorted(missing)}"
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def _module(name: str, source: str, path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = path
    module.logger = logging.getLogger(name)  # type: ignore[attr-defined]  # vLLM's init_logger
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def install(version: str) -> types.ModuleType:
    """Register vLLM ``version``'s ``vllm.distributed.utils`` and ``...pynccl_wrapper`` (the
    definitions the module docstring names) in this process; returns the first. Call it
    only in a process that plays a vLLM rank."""
    with zipfile.ZipFile(wheel(version)) as archive:
        sources = {path: archive.read(path).decode() for path in _TAKE}
    for package in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
        sys.modules.setdefault(package, types.ModuleType(package))
    wrapper = _module(
        "vllm.distributed.device_communicators.pynccl_wrapper",
        _definitions(sources[_NCCL], _TAKE[_NCCL], _NCCL),
        f"vllm-{version}/{_NCCL}",
    )
    utils = _module(
        "vllm.distributed.utils",
        _definitions(sources[_UTILS], _TAKE[_UTILS], _UTILS),
        f"vllm-{version}/{_UTILS}",
    )
    utils.ncclUniqueId = wrapper.ncclUniqueId  # type: ignore[attr-defined]  # for the tests
    return utils
