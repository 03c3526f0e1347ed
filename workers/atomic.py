"""Atomic writes (no torch import, so every part of the project can use them): what was saved
is either the old file/folder or the new one, never a half-written mix."""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
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


def _default_modes(root: Path) -> None:
    """Give ``root`` and what it holds the modes a plain mkdir / open would (0o777 / 0o666
    less the umask): ``tempfile.mkdtemp`` makes 0o700 and safetensors writes 0o600, so a saved
    model or checkpoint was unreadable to the rest of a cluster's users and groups."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for d, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(d, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(d, name), 0o666 & ~mask)


def replace_dir(tmp: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Put directory ``tmp`` at ``folder``. Over an existing folder the two are exchanged in
    one atomic step where Linux allows it (a reader, or a crash, sees the old folder or the
    new one, never none), then the old one is deleted. Elsewhere: two renames (the old one is
    moved aside, to ``.NAME.old<pid>``, and removed only after the new one is in place).
    ``tmp``'s tree first gets the modes of a plain mkdir / file (umask applied)."""
    tmp, folder = Path(tmp), Path(folder)
    _default_modes(tmp)
    if not folder.exists():
        os.rename(tmp, folder)
    elif _exchange(tmp, folder):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
    else:
        old = folder.with_name(f".{folder.name}.old{os.getpid()}")
        os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
