"""NFSWorkspace: a directory shared by all ranks, one state file per rank.

Compatible with ModelOpt's ``modelopt.torch.export.distribute.NFSWorkspace`` (same
constructor, property, methods and file names ``rank_<r>_state.pth`` holding
``{"config": ..., "weight": ...}`` written by ``torch.save``), and better in these ways:

* a state file is replaced atomically (written to a temporary file in the same directory,
  fsynced, then ``os.replace``d), so a reader never sees half a file, and the previous state
  stays readable until the new one is complete;
* it is read with ``torch.load(weights_only=True)``: reading executes no pickled code; and
  only once its archive holds no compressed member (``codec.load_saved``): a few KB must
  not become GBs in the reader;
* every rank creates the directory (not only rank 0), so it exists before any rank writes;
* the rank in file names can be given (``rank=``), which stateless groups need.

As in ModelOpt, reads and writes involve no collective and no barrier: synchronizing the ranks
is the caller's job.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from bridge_py.distributed.distribute.codec import load_saved
from bridge_py.distributed.errors import DistributedError, ObjectLoadError

__all__ = ["NFSWorkspace", "NfsChannel"]

# The folder of one call in a workspace is named this, then the call's token.
NAME_PREFIX = "bpd"

_NOT_INITIALIZED = "NFSWorkspace is not initialized!"


def _default_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable where the file system allows it (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` by what ``write`` writes: readers see the old file or the new one,
    whole (a temporary file in the same folder, fsynced, then renamed over ``path``).
    An OSError names ``path`` (a full disk's says only "No space left on device")."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    _fsync_dir(path.parent)


def _remove_state(path: Path) -> None:
    """Remove a state file and any temporary file that a crashed write of it left."""
    path.unlink(missing_ok=True)
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        leftover.unlink(missing_ok=True)


def _state_path(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank}_state.pth"


def _read_state(path: Path, what: str, *, own_folder: bool) -> bytes:
    """The bytes of the state file ``path`` (``what`` names it in errors).

    A workspace is a directory others may write, and a state file another rank's word, so
    the file is opened without following a link and without blocking (a FIFO), and read
    only if it is a regular file, as long as it says it is. ``own_folder``: the folder is
    the caller's own workspace, which may be reached through a link; else (a gather's
    folder, made in it) a link there is refused too. FileNotFoundError when there is no
    file; DistributedError naming it for anything else.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        folder = os.open(
            path.parent, (flags & ~os.O_NOFOLLOW if own_folder else flags) | os.O_DIRECTORY
        )
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refused(what, f"its folder cannot be opened as one ({exc.strerror})") from None
    try:
        fd = os.open(path.name, flags, dir_fd=folder)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refused(what, f"it cannot be opened as a file ({exc.strerror})") from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(what, "it is not a regular file")
        try:
            data = os.pread(fd, info.st_size, 0) if info.st_size else b""
        except (OSError, MemoryError, OverflowError) as exc:
            raise _refused(what, f"its {info.st_size} bytes cannot be read ({exc!r:.80})") from None
        if len(data) != info.st_size:
            raise _refused(what, f"it holds {len(data)} of the {info.st_size} bytes it claims")
        return data
    finally:
        os.close(fd)


def _refused(what: str, why: str) -> DistributedError:
    return DistributedError(f"refused {what}: {why}")


class NFSWorkspace:
    """A shared workspace implementation using Network File Storage (NFS).

    NOTE: all read/write/modifition to the NFS dir do not involve any collective
    communication nor barrier. It is users' responsibility to synchronize all ranks (local
    and remote processes).

    This implementation uses ``torch.save`` and ``torch.load`` (with ``weights_only=True``)
    for serialization.

    Args:
        workspace_path: the path to the NFS directory for postprocess cross rank
            communication. If not provided, SharedMemory will be used instead.
        rank: the rank that names this process's state file (keyword only, an extension);
            by default torch.distributed's rank when it is initialized, else 0.
    """

    def __init__(self, workspace_path: Path | str | None = None, *, rank: int | None = None):
        """Create the NFS work dir and clean up existing state files."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be non-negative, got {rank}")
        self.path = Path("") if workspace_path is None else Path(workspace_path)
        self._is_initialized = workspace_path is not None
        self.rank = _default_rank() if rank is None else rank
        if self._is_initialized:
            self.path.mkdir(parents=True, exist_ok=True)
            self.state_path = self._get_state_path(self.rank)
            self._clean_up()

    @property
    def is_initialized(self) -> bool:
        """Whether the workspace is initialized."""
        return self._is_initialized

    def write_configs_and_weights(
        self, config_json: dict[str, Any], weights: dict[str, Any]
    ) -> None:
        """All ranks write the state file to the shared NFS dir.

        The file is replaced atomically: readers see the previous state or this one, whole.

        Args:
            config_json: model or module config in json
            weights: module weights in torch's state_dict format
        """
        self._check()
        state = {"config": dict(config_json), "weight": dict(weights)}
        _write_atomically(self.state_path, lambda file: torch.save(state, file))

    def read_configs_and_weights_from_rank(
        self, target_rank: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """All ranks read the target_rank state file.

        Args:
            target_rank: the target rank

        Returns:
            the model/module config and the weights; ``(None, None)`` when that rank has no
            state file.
        """
        self._check()
        path = self._get_state_path(target_rank)
        what = f"the state file of rank {target_rank}, {str(path)!r}"
        try:
            data = _read_state(path, what, own_folder=True)
        except FileNotFoundError:
            return None, None
        try:
            state = load_saved(data)
        except Exception as exc:  # torch.load's (a refused global, ...), the archive's
            raise ObjectLoadError(f"{what} does not unpickle as a state file: {exc}") from exc
        if not (isinstance(state, dict) and {"config", "weight"} <= state.keys()):
            raise _refused(what, "it holds no dict of 'config' and 'weight'")
        return state["config"], state["weight"]

    def _check(self) -> None:
        if not self._is_initialized:
            raise ValueError(_NOT_INITIALIZED)

    def _get_state_path(self, target_rank: int) -> Path:
        """Return the state file path of a particular rank."""
        self._check()
        return _state_path(self.path, target_rank)

    def _clean_up(self) -> None:
        """Remove this rank's state file and any temporary file a crashed write left."""
        self._check()
        _remove_state(self.state_path)


class NfsChannel:
    """The files of one gather call, one per writing rank, in a folder of the workspace ``root``.

    The same carrier as :class:`~bridge_py.distributed.distribute.shm.ShmChannel` (publish,
    take, remove), for configs only: a file holds the bytes that :data:`~.codec.CONFIGS`
    encodes (the config's ``torch.save`` file). The folder is named after the call's token, so
    two calls sharing a workspace never touch each other's files. Files are replaced
    atomically, so the reader sees a whole file or none (a write that failed, or a workspace
    that is not shared).
    """

    def __init__(self, root: Path | str, token: int) -> None:
        self.folder = Path(root) / f"{NAME_PREFIX}{token:016x}"

    def publish(self, rank: int, parts: Sequence[Any]) -> None:
        """Write ``rank``'s state file, the bytes of ``parts`` (creating the call's folder,
        or finding it made by another rank: a folder, not a link to one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.folder.is_symlink():
            raise _refused(f"the folder {str(self.folder)!r} of a gather", "it is a link")
        _write_atomically(_state_path(self.folder, rank), lambda file: file.writelines(parts))

    def take(self, rank: int, decode: Callable[[memoryview, str], Any]) -> Any:
        """Read ``rank``'s state file, delete it, and return ``decode(its bytes, what)``."""
        path = _state_path(self.folder, rank)
        what = f"the value of rank {rank} in {str(path)!r}"
        try:
            data = _read_state(path, what, own_folder=False)
        except FileNotFoundError:
            raise DistributedError(
                f"rank {rank} left no state file in {self.folder}: it failed to write it, or "
                "the workspace is not shared by all ranks of the group"
            ) from None
        _unlink_in(self.folder, path.name)
        return decode(memoryview(data), what)

    def remove(self, rank: int) -> None:
        """Delete ``rank``'s files, then the folder if it is empty (idempotent). Nothing is
        deleted through a folder that is a link."""
        if self.folder.is_symlink():
            return
        with contextlib.suppress(OSError):
            _remove_state(_state_path(self.folder, rank))
        with contextlib.suppress(OSError):
            self.folder.rmdir()


def _unlink_in(folder: Path, name: str) -> None:
    """Remove ``name`` from ``folder`` if both are there, never through a link."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        fd = os.open(folder, flags)
        try:
            os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
