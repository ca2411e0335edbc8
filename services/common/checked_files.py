"""Reading a file another local user might have planted or swapped: checked before it is read.

``read_checked`` opens without following a final symbolic link and without blocking (a FIFO or a
device at the path is refused, never waited on), then checks the open file itself (fstat, so the
path cannot be swapped between check and read): a regular file, owned by this user or root, that
no one else may write (``private``: no group or other access at all, for secrets), at most
``max_bytes``; only then is it read, and never more than that. A symbolic link is refused, so a
file mounted through links (Kubernetes ConfigMaps and Secrets) is named by its real path."""
from __future__ import annotations

import errno
import os
import stat


def read_checked(path: str | os.PathLike, what: str, max_bytes: int, *, private: bool = False) -> bytes:
    """The file's bytes after the checks above; ValueError naming what, the file and the fault."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symbolic link is refused" if exc.errno == errno.ELOOP else exc.strerror
        raise ValueError(f"{what} {path}: cannot open: {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path}: not a regular file (a FIFO, a device or a directory is refused)")
        if st.st_uid not in (os.getuid(), 0):
            raise ValueError(f"{what} {path}: owned by uid {st.st_uid}, not by this user ({os.getuid()}) or root")
        mode = stat.S_IMODE(st.st_mode)
        if private and mode & 0o077:
            raise ValueError(f"{what} {path}: readable or writable by group or others (mode {mode:04o}): chmod 600 it")
        if mode & 0o022:
            raise ValueError(f"{what} {path}: writable by group or others (mode {mode:04o}): chmod go-w it")
        if st.st_size > max_bytes:
            raise ValueError(f"{what} {path}: larger than {max_bytes} bytes")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:   # it grew after the check
        raise ValueError(f"{what} {path}: larger than {max_bytes} bytes")
    return data
