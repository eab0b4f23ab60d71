"""Files deepshard writes in a run or checkpoint dir, opened so that what is already at the path cannot
redirect the write: never through a symlink (``O_NOFOLLOW``), and only into a regular file.

A shared or downloaded checkpoint dir can carry ``.deepshard.lock -> /etc/passwd``, and the app often
runs as root: following the link would overwrite its target.  A FIFO would block the open forever, a
directory would end in a traceback.  Each refusal is one ValueError naming the path and what it is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import IO, Any, Literal

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}


def not_regular(path: str | os.PathLike, st_mode: int) -> ValueError:
    """The one-line refusal of ``path``, which is not a regular file (a link, a directory, a FIFO...)."""
    kind = _KINDS.get(stat.S_IFMT(st_mode), "not a regular file")
    return ValueError(f"{os.fspath(path)}: is {kind}, not a regular file; deepshard writes only its own plain "
                      "files there (remove it, or use another directory)")


def open_regular(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """An fd on the regular file ``path`` (``flags`` as for ``os.open``, without ``O_TRUNC``: a caller
    truncates once the file is known to be its own), or ValueError if ``path`` is a symlink or not a
    regular file.  ``O_NONBLOCK`` keeps a FIFO from blocking the open until it is refused."""
    assert not flags & os.O_TRUNC, "truncate after the checks (os.ftruncate), never at the open"
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link, a directory, a FIFO without reader
            raise not_regular(path, os.lstat(path).st_mode) from None
        raise
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise not_regular(path, st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


_FLAGS = {"w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def open_file(path: str | os.PathLike, mode: Literal["w", "a", "wb", "ab"]) -> IO[Any]:
    """``open(path, mode)`` for writing, with :func:`open_regular`'s refusals."""
    fd = open_regular(path, _FLAGS[mode[0]])
    if mode[0] == "w":
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode)


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """``Path(path).write_text(text)`` with :func:`open_regular`'s refusals (fsynced if asked)."""
    with open_file(path, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
