"""Loopback helpers (rapo_ray/core/net.py)."""

from __future__ import annotations

import shutil
import socket
import tempfile

from rapo_ray.core.net import free_port, short_temp_dir


def test_free_port_can_be_bound_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_ray_temp_folder_stays_short_enough_for_its_sockets(tmp_path, monkeypatch):
    """Ray's Unix sockets live some 75 bytes below its temp root and may not exceed 107: a long TMPDIR (a CI's, a
    pytest tmp_path) must not make Ray fail to start ('AF_UNIX path length cannot exceed 107 bytes')."""
    long = tmp_path / ("x" * 40)
    long.mkdir()
    made = []
    try:
        monkeypatch.setattr(tempfile, "tempdir", "/tmp")  # a short TMPDIR is used as it is
        made.append(short_temp_dir("rapo_"))
        monkeypatch.setattr(tempfile, "tempdir", str(long))  # a long one is not
        made.append(short_temp_dir("rapo_"))
        assert all(d.startswith("/tmp/rapo_") and len(d) + 75 <= 107 for d in made)
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
