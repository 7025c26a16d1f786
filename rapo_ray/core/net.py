"""Loopback networking helpers shared by the launcher, the managed milvus-lite server, benchmarks and tests."""

from __future__ import annotations

import socket
import tempfile


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A Ray session's longest socket path below its temp root ("/ray/session_<date>_<time>_<us>_<pid>/sockets/
# plasma_store.N" and a little room): Unix socket paths hold at most 107 bytes.
_RAY_SOCKET_TAIL = 75


def short_temp_dir(prefix: str) -> str:
    """A new folder for a Ray session's files whose sockets fit the 107-byte limit: under the system temp folder
    (TMPDIR), or under /tmp when that one is too long for them."""
    root = tempfile.gettempdir()
    if len(root) + 1 + len(prefix) + 8 + _RAY_SOCKET_TAIL > 107:
        root = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=root)
