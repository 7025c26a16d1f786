"""Runs inside the sandbox child process: installs a guard, then executes the model's code.

Layers (the parent adds the rest: rlimits, an unprivileged user, a network namespace, a wall clock):
- an audit hook that cannot be removed once installed: no writes, deletes or renames outside the
  working directory, no sockets, no new processes;
- the code runs as ``__main__`` with stdout going to a size-limited file in the working directory.
Usage: python -I -S sandbox_runner.py CODE_FILE
"""

import os
import sys

WORK = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_BLOCKED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "os.kill", "os.killpg", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "ctypes.dlopen", "ctypes.cdata"}
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


if __name__ == "__main__":
    main()
