"""Atomic, durable writes (no torch import, so every part of the project can use them): what
was saved is either the old file/folder or the new one, never a half-written mix, also after a
power loss or a node crash. The new data is fsynced before the rename that commits it, and the
parent folder after it (a rename is only durable once its directory is): without that, a crash
could leave the renamed folder holding zero-length files.

``atomic_dir`` / ``atomic_file`` give a temp folder / file beside the target to write into and
put it in place (``replace_dir`` / a rename) when the block ends, or remove it when the block
raises; ``remove_stale_temps`` sweeps the temp folders of saves that were killed, and
``restore_moved_aside`` what a killed two-rename replacement left. ``file_digest``
and ``folder_digests`` are the checksums saved folders record."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import shutil
import stat
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@functools.cache
def _renameat2():
    """glibc's renameat2 (Linux >= 3.15, glibc >= 2.28), or None."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap paths ``a`` and ``b`` in one atomic step (renameat2 RENAME_EXCHANGE); False where
    the platform or the file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _umask() -> int:
    """The process umask (read from /proc where possible: setting it to read it races threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# directory fsync is refused by some file systems (some FUSE and network mounts): nothing more
# can be done there, so EINVAL and ENOTSUP (only, and only for a directory) are ignored; any
# other error (EIO) is raised
_NO_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def fsync_path(path: str | os.PathLike, mode: int | None = None) -> None:
    """Flush file ``path``'s data, or directory ``path``'s entries (the names created, renamed or
    removed in it), to the disk; first give it ``mode`` when set."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in _NO_DIR_FSYNC or not stat.S_ISDIR(os.fstat(fd).st_mode):
                raise
    finally:
        os.close(fd)


def _settle(root: Path) -> None:
    """Make the tree at ``root`` ready to be renamed into place: every folder and file gets the
    mode a plain mkdir / open would give (0o777 / 0o666 less the umask: ``tempfile.mkdtemp``
    makes 0o700 and safetensors writes 0o600, so a saved model or checkpoint was unreadable to
    the rest of a cluster's users and groups) and is fsynced, the files before their folder and
    each folder before its parent (bottom-up). Symbolic links are left as they are."""
    mask = _umask()
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            f = os.path.join(d, name)
            if not os.path.islink(f):
                fsync_path(f, 0o666 & ~mask)
        fsync_path(d, 0o777 & ~mask)


def replace_dir(tmp: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Put directory ``tmp`` at ``folder``. Over an existing folder the two are exchanged in
    one atomic step where Linux allows it (a reader, or a crash, sees the old folder or the
    new one, never none), then the old one is deleted. Elsewhere: two renames (the old one is
    moved aside, to ``.NAME.old<pid>``, and removed only after the new one is in place).
    ``tmp``'s tree first gets the modes of a plain mkdir / file (umask applied) and is fsynced
    (every file and folder); ``folder``'s parent is fsynced after the rename, before the old
    copy is deleted. ``tmp`` must be on the same file system, normally beside ``folder``."""
    tmp, folder = Path(tmp), Path(folder)
    _settle(tmp)
    if not folder.exists():
        os.rename(tmp, folder)
        fsync_path(folder.parent)
    elif _exchange(tmp, folder):
        fsync_path(folder.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
    else:
        old = folder.with_name(f".{folder.name}.old{os.getpid()}")
        os.rename(folder, old)
        os.rename(tmp, folder)
        fsync_path(folder.parent)
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temp folder beside ``target`` (``.NAME.tmpXXXXXXXX``, its parent created)
    to write into; when the block ends, put it at ``target`` with ``replace_dir`` (atomic,
    durable). When the block, or the replacement, raises, the temp folder is removed and
    ``target`` is left as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
    try:
        yield tmp
        replace_dir(tmp, target)
    except BaseException:  # a full disk, Ctrl-C, a writer's error: no half-written copy left taking space
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp file path beside ``path`` (``.NAME.tmp<pid>``, its parent created) to write;
    when the block ends, fsync it, rename it over ``path``, then fsync the folder (the rename is
    the commit point). When the block raises, the temp file is removed and ``path`` is left as
    it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no temp file left beside ``path``
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through ``atomic_file``."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def remove_stale_temps(folder: str | os.PathLike, name: str | re.Pattern) -> None:
    """Remove the entries of ``folder`` whose name fully matches regex ``name``: temp folders of
    saves killed before they could clean up (kill -9). Folders are deleted whole, files and
    links unlinked; errors are ignored (the next save tries again)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # no folder yet: nothing to sweep
        return
    for p in entries:
        if not re.fullmatch(name, p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def restore_moved_aside(folder: str | os.PathLike) -> None:
    """Finish what a ``replace_dir`` killed on its two-rename path (no atomic exchange) left in
    ``folder``: an old copy moved aside (``.NAME.old<pid>``) is deleted when ``NAME`` is in
    place, and put back as ``NAME`` when the new one never got there (it is the last complete
    copy). Errors are ignored (the next call tries again)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return
    for p in entries:
        m = re.fullmatch(r"\.(.+)\.old\d+", p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        target = p.with_name(m.group(1))
        with contextlib.suppress(OSError):
            if target.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.rename(p, target)
                fsync_path(p.parent)


def file_digest(path: str | os.PathLike, algo: str) -> str:
    """Hex digest of a file's bytes, read in 16 MiB blocks: ``algo`` "crc32" (8 hex digits,
    ~2 GB/s) or a hashlib name ("sha256")."""
    crc, h = 0, None if algo == "crc32" else hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            if h is None:
                crc = zlib.crc32(block, crc)
            else:
                h.update(block)
    return f"{crc:08x}" if h is None else h.hexdigest()


def folder_digests(folder: str | os.PathLike, algo: str) -> dict[str, str]:
    """{relative POSIX path: ``file_digest``} of every file under ``folder``, sorted by path."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): file_digest(p, algo) for p in sorted(folder.rglob("*")) if p.is_file()}
