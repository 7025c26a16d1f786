"""Tests whose work is one long subprocess can start it when the session begins instead of when their turn comes.

The unit half runs in process, one test at a time on one thread: on a 2-core box one core idles through it (49% busy,
measured). A test marked ``@pytest.mark.starts_early(command=...)`` has its command started, niced, by the session's
first fixture; it fills that idle core, and the test itself, ordered right after the unit half (tests/conftest.py),
waits for the command and checks its output as before. Same command, same checks: only the start moves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# niceness of a background command: the tests in the foreground keep the cores they ask for, the command takes the
# rest (a niced process still runs, with a tenth of the share of a normal one when both want a core)
NICENESS = 10


@dataclass
class Finished:
    """What a background command left: its exit status, its output and its work folder."""

    returncode: int
    stdout: str
    stderr: str
    work: Path


class BackgroundCommand:
    """One command running in its own process group, output to files under ``work``; ``wait`` gives ``Finished``."""

    def __init__(self, argv: list, work: Path):
        self.work = work
        self.argv = [str(a) for a in argv]
        self._out, self._err = open(work / "stdout.txt", "w"), open(work / "stderr.txt", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._out,
            stderr=self._err,
            start_new_session=True,  # its own process group: ``stop`` ends it and whatever it started
            preexec_fn=lambda: os.nice(NICENESS),
        )

    def wait(self, timeout_s: float) -> Finished:
        """Block until the command ends, at most ``timeout_s`` after its start; past that it is stopped and
        ``TimeoutError`` names it."""
        try:
            self.proc.wait(timeout=max(0.0, self.started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(
                f"{' '.join(self.argv)} ran past {timeout_s:.0f} s; its output is in {self.work}"
            ) from None
        self._out.close()
        self._err.close()
        return Finished(
            self.proc.returncode,
            (self.work / "stdout.txt").read_text(errors="replace"),
            (self.work / "stderr.txt").read_text(errors="replace"),
            self.work,
        )

    def stop(self) -> None:
        """End the command's process group (TERM, then KILL after 10 s); nothing if it has ended."""
        if self.proc.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue


class EarlyStarts:
    """The session's background commands, by the node id of the test that asked for each."""

    def __init__(self):
        self.commands: dict[str, BackgroundCommand] = {}

    def start(self, nodeid: str, argv: list, work: Path) -> None:
        self.commands[nodeid] = BackgroundCommand(argv, work)

    def wait(self, nodeid: str, timeout_s: float) -> Finished:
        if nodeid not in self.commands:
            raise KeyError(f"{nodeid} asked for its background command, but none was started for it")
        return self.commands[nodeid].wait(timeout_s)

    def stop_all(self) -> None:
        for command in self.commands.values():
            command.stop()
