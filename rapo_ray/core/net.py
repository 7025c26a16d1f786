"""Loopback networking helpers shared by the launcher, the managed milvus-lite server, benchmarks and tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
