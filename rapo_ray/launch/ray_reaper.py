"""Tears down the local Ray a job started once the job's driver is gone, however it went (SIGKILL included).

Ray ties its GCS and raylet to the driver that started them, but the dashboard and runtime-env agents and idle
workers only notice much later (tens of seconds after a driver SIGKILL). ``watch(session_dir)``
starts this module as a small process in a session of its own, holding the read end of a pipe whose write end
only the driver has: when the driver ends, the pipe reads EOF, and after a short grace (a clean exit has run
``ray.shutdown()`` already) every process of that Ray session (its command line names the session folder, unique
to the Ray this job started, or it holds a file in it open) gets SIGTERM, then SIGKILL. Nothing else is
touched.

    python -m rapo_ray.launch.ray_reaper SESSION_DIR     (stdin: the driver's pipe)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 2.0  # after the driver ended, before looking: a clean shutdown finishes in this time
TERM_WAIT_S = 5.0  # after SIGTERM, before SIGKILL


def watch(session_dir: str) -> subprocess.Popen:
    """Start the reaper for the Ray session in ``session_dir`` (the caller must keep the returned handle
    referenced: its stdin is the pipe whose end signals the driver's)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rapo_ray.launch.ray_reaper", session_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver's process group must not take the reaper first
    )


def session_processes(session_dir: str) -> list[int]:
    """PIDs of the live processes of ``session_dir``'s Ray session (this one excluded): those whose command line
    names the session, or that hold a file of it open (the agents and workers rename themselves, ``ray::...``,
    but keep their logs in the session folder open)."""
    real = os.path.realpath(session_dir)
    name = os.path.basename(real).encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if "\nState:\tZ" in (p / "status").read_text():
                continue
            if name in (p / "cmdline").read_bytes() or _holds_file_under(p, real):
                out.append(int(p.name))
        except OSError:
            continue
    return out


def _holds_file_under(proc: Path, folder: str) -> bool:
    for fd in (proc / "fd").iterdir():
        try:
            if os.readlink(fd).startswith(folder + "/"):
                return True
        except OSError:
            continue
    return False


def reap(session_dir: str) -> int:
    """SIGTERM every process of the session, SIGKILL what is left after ``TERM_WAIT_S``; returns how many there
    were."""
    pids = session_processes(session_dir)

    def send(sig, to) -> None:
        for pid in to:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    send(signal.SIGTERM, pids)
    deadline = time.monotonic() + TERM_WAIT_S
    while (alive := set(pids) & set(session_processes(session_dir))) and time.monotonic() < deadline:
        time.sleep(0.2)
    send(signal.SIGKILL, alive)
    return len(pids)


def main() -> None:
    session_dir = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's end matters
    sys.stdin.buffer.read()  # returns at EOF: the driver exited or was killed
    time.sleep(GRACE_S)
    reap(session_dir)


if __name__ == "__main__":
    main()
