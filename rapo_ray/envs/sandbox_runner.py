"""Runs inside the sandbox: installs a guard, then executes the model's code.

Layers (the parent adds the rest: an unprivileged user, a network namespace, a wall clock):
- an audit hook that cannot be removed once installed: no writes, deletes or renames outside the
  working directory, no sockets, no new processes;
- the code runs as ``__main__`` with stdout going to a size-limited file in the working directory.

Two ways to run:
  python -I -S sandbox_runner.py CODE_FILE       one call per process (the parent sets the rlimits)
  python -I -S sandbox_runner.py --serve LIMITS  a fork server: reads one JSON request per line on stdin
      ({"code", "timeout_s"}), forks a fresh child per call (private directory, rlimits, the guard, then
      the code), waits for it up to the timeout (killing its process group after), and answers one JSON
      line ({"rc", "timed_out", "stdout", "stderr"}). The server itself never runs model code; a call
      costs a fork instead of a python start-up (~1 ms vs ~50 ms).
"""

import os
import sys

WORK = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.link",
    "os.symlink",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copyfile",
}
_BLOCKED = {
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "subprocess.Popen",
    "os.kill",
    "os.killpg",
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "ctypes.dlopen",
    "ctypes.cdata",
}
_realpath = os.path.realpath
_join = os.path.join
_fsdecode = os.fsdecode


def _inside(path) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor
    real = _realpath(_join(WORK, _fsdecode(path)))
    return real == WORK or real.startswith(WORK + os.sep)


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None:
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {a}")
    elif event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")


def main() -> None:
    with open(sys.argv[1]) as f:
        code = f.read()
    compiled = compile(code, "<python>", "exec")
    sys.addaudithook(_hook)
    exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})


# ---------------------------------------------------------------- fork server


def _child(code: str, work: str, limits: dict) -> None:
    """In the forked child: never returns."""
    global WORK
    import io  # imported by the server already (serve()): free here
    import resource
    import traceback

    rc = 1
    try:
        os.setsid()
        os.chdir(work)
        WORK = _realpath(work)
        cpu, mem, fsize, nproc = (
            limits["cpu_s"],
            limits["memory_mb"] << 20,
            int(limits["file_size_mb"] * (1 << 20)),
            limits["max_processes"],
        )
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
        try:
            compiled = compile(code, "<python>", "exec")
            sys.addaudithook(_hook)
            exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc)


def _wait(pid: int, timeout_s: float):
    """(exit code as subprocess reports it, timed out?) of the child; kills its group at the timeout."""
    import select
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    try:
        while True:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid:
                return os.waitstatus_to_exitcode(status), False
            left = deadline - time.monotonic()
            if left <= 0:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status), True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.002))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def serve(limits: dict) -> None:
    import io  # noqa: F401  (what every child needs, imported once here instead of after each fork)
    import json
    import resource  # noqa: F401
    import shutil
    import tempfile
    import traceback  # noqa: F401

    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = json.loads(line)
        work = tempfile.mkdtemp(prefix="rapo_py_")
        try:
            pid = os.fork()
            if pid == 0:
                _child(req["code"], work, limits)
            rc, timed_out = _wait(pid, float(req["timeout_s"]))
            texts = []
            for name in ("stdout.txt", "stderr.txt"):
                try:
                    with open(os.path.join(work, name), "rb") as f:
                        texts.append(f.read(limits["read_bytes"]).decode("utf-8", "replace"))
                except OSError:
                    texts.append("")
            reply = {"rc": rc, "timed_out": timed_out, "stdout": texts[0], "stderr": texts[1]}
        except Exception as exc:  # answer, never die: the parent would have to restart us
            reply = {
                "rc": 1,
                "timed_out": False,
                "stdout": "",
                "stderr": f"sandbox server: {type(exc).__name__}: {exc}",
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        import json

        serve(json.loads(sys.argv[2]))
    else:
        main()
