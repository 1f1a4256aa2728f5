"""Checkpoint files written atomically on any local filesystem, leaving nothing behind on a crash.

Lightning's own save serialises to memory and lets fsspec move a temporary file from the
system's temporary directory into place; when the checkpoint directory is on another
filesystem that move is a copy, so a crash during it truncates ``last.ckpt``, and a crash
mid-save leaves the temporary file behind. Here the file is written *in the target directory*
(same filesystem), flushed and fsync'ed, then renamed over the old one, which POSIX makes
atomic: a reader sees the old checkpoint or the new one, never a part.

Where Linux offers ``O_TMPFILE`` (ext4, xfs, btrfs, tmpfs) the data goes into an unnamed file
that only gets a name once complete, so a process killed mid-write leaves no file at all;
elsewhere a hidden ``.NAME.pipemare-*.tmp`` is used, removed on error and swept by the next save
into the same directory. Remote URLs (``s3://`` ...) keep Lightning's own path.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "LightningAtomicCheckpointIO", "atomic_save"]

_TAG = ".pipemare-"


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse to open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sweep(directory: str, name: str) -> None:
    """Remove temporary files a killed writer of ``name`` left in ``directory``."""
    for stale in Path(directory).glob(f".{name}{_TAG}*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def _link_fd(fd: int, link: str) -> bool:
    """Give the unnamed file open as ``fd`` the name ``link`` (linkat following /proc's link;
    Python's os.link does not follow it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        at_fdcwd, at_symlink_follow = -100, 0x400
        done = libc.linkat(
            at_fdcwd, f"/proc/self/fd/{fd}".encode(), at_fdcwd, link.encode(), at_symlink_follow
        )
    except (OSError, AttributeError):
        return False
    return done == 0


def _write_unnamed(obj: Any, directory: str, path: str) -> bool:
    """Write through O_TMPFILE and link it in; False where the filesystem lacks it."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return False
    try:
        fd = os.open(directory, flag | os.O_WRONLY, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
        # linkat cannot replace a file: give it a unique name, then rename over the target
        link = f"{directory}/.{os.path.basename(path)}{_TAG}{os.getpid()}-{id(f)}.tmp"
        if not _link_fd(f.fileno(), link):
            return False  # the unnamed file vanishes with its descriptor
    try:
        os.replace(link, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(link)
        raise
    return True


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that replaces ``path`` all at once or not at all.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> atomic_save({"w": torch.ones(2)}, os.path.join(d, "last.ckpt"))
        >>> sorted(os.listdir(d)), torch.load(os.path.join(d, "last.ckpt"))["w"].tolist()
        (['last.ckpt'], [1.0, 1.0])
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(path)
    _sweep(directory, name)
    if os.path.isdir(path):  # per-stage shards of the same name, replaced by one file
        old = f"{directory}/.{name}{_TAG}old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        try:
            atomic_save(obj, path)
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return
    if not _write_unnamed(obj, directory, path):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}{_TAG}", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    _fsync_dir(directory)


if TYPE_CHECKING:  # the mixin is typed over the base it always comes with
    _IOBase = TorchCheckpointIO
else:
    _IOBase = object


class _AtomicWrites(_IOBase):
    """Lightning's ``TorchCheckpointIO`` saving atomically to local paths (a mixin: each
    Lightning package has its own base class)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_save(checkpoint, path)


class AtomicCheckpointIO(_AtomicWrites, TorchCheckpointIO):
    """``TorchCheckpointIO`` (``lightning_fabric``, for ``pytorch_lightning``) that writes each
    local checkpoint atomically (:func:`atomic_save`)."""


#: the same over ``lightning.fabric``, for ``lightning.pytorch``; None where not installed
LightningAtomicCheckpointIO: type | None = None

if importlib.util.find_spec("lightning") is not None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as _LightningTorchIO

    class _LightningAtomicCheckpointIO(_AtomicWrites, _LightningTorchIO):
        """``TorchCheckpointIO`` (``lightning.fabric``, for ``lightning.pytorch``) that writes
        each local checkpoint atomically (:func:`atomic_save`)."""

    LightningAtomicCheckpointIO = _LightningAtomicCheckpointIO
