"""Runs the model's python code in a call of its own, isolated by the operating system. Started by
``rapo_ray/envs/tools.py`` as ``python -I -S sandbox_runner.py MODE CONFIG`` (standard library only):

    --serve   a fork server: one JSON request per line on stdin ({"code", "timeout_s"}), one JSON reply per
              line on stdout ({"rc", "timed_out", "stdout", "stderr"}); a call costs forks, not a python start
    --once    the same for one request, then exit (rollout.python_sandbox=subprocess)
    --probe   set up one isolated call running ``print(1)``; exit 0 if that works, else print why and exit 1

Both modes run a call through ``run_call``: the same code, so the same result for the same program.

isolation "namespaces" (the default).
  server      at start: continues as PID 1 of a new PID namespace; new mount, network (no interfaces), UTS and
              cgroup namespaces; builds the calls' root on a tmpfs (the host's /usr, /lib*, /bin symlinks and the
              python's lib folder read-only, /dev/{null,zero,urandom}, /proc, an empty /work), pivot_roots into
              it and detaches the host's tree. Started unprivileged, it first enters a user namespace.
  call        one fork per call, made ahead (a spare waits between calls): the server unshares new mount, PID
              and IPC namespaces, mounts a size-limited tmpfs on /work (the only writable place), keeps a
              descriptor of it, forks the call process and setns-es straight back to its own namespaces. The
              call process is PID 1 of the new PID namespace: it mounts its /proc, drops to a uid of its own (as
              root) or every capability (in a user namespace), sets no_new_privs, the rlimits and its stdio,
              closes inherited descriptors, then reads its code from a pipe and runs it. The server waits for it
              (killing it at the timeout) and reads its output through the /work descriptor. When PID 1 ends,
              however it ends, the kernel kills every process left in its PID namespace (nothing a call starts
              outlives it), and closing the descriptor frees its /work.
isolation "process" (opt-in, for machines that refuse namespaces): the call is forked directly into a private
  host temp folder, under a uid of its own when root, with the rlimits and the audit hook; its process group is killed
  after it returns, which a ``setsid`` escapes. Weaker; tools.py announces it.

The audit hook (no writes outside the working folder, no sockets, no new processes) runs in both as a first,
cheap line; with namespaces nothing depends on it.
"""

import os
import sys

CALL_UID_BASE = 200000  # a call runs as CALL_UID_BASE + its server's pid (when started as root)
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


# ---------------------------------------------------------------- kernel interfaces (ctypes)

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
# Per call: mount (its /work, its /proc), PID (nothing outlives it), IPC (System V objects outlive processes).
CALL_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
# Per server: network, UTS, cgroup. A server runs one call at a time and every process of a call is dead before
# the next starts; what outlives processes in these namespaces (addresses, routes, filters, hostname) needs
# capabilities no call has. So they separate calls as well as per-call ones would, for ~0.5-2.5 ms less a call.
# And a mount and an IPC namespace of the server's own: the ones it returns to after each call's fork (setns needs
# capabilities over them, which a server in a user namespace has only for namespaces made inside it).
SERVER_NAMESPACES = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWCGROUP
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_REC, MS_PRIVATE = 1024, 2048, 1 << 21, 16384, 1 << 18
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 2, 1, 38, 24
# pivot_root and capset have no glibc wrapper: syscall numbers per architecture
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
_libc = None


def _c():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_c().unshare(flags), f"unshare({flags:#x})")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_c().mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {src} on {target}")


def _syscall(name: str, *args) -> None:
    import platform

    number = _SYSCALLS.get(platform.machine(), {}).get(name)
    if number is None:
        raise OSError(f"{name}: no syscall number known for {platform.machine()}")
    _check(_c().syscall(number, *args), name)


def _preload() -> None:
    """Load ctypes, libc and what a call's setup imports once, in the server: a fork inherits them (loading
    ctypes after each fork cost ~5 ms per call), and a call that dropped to nobody may not be able to read the
    interpreter's library to import them."""
    import ctypes  # noqa: F401
    import io  # noqa: F401
    import platform
    import resource  # noqa: F401
    import select  # noqa: F401
    import shutil  # noqa: F401
    import signal  # noqa: F401
    import tempfile  # noqa: F401
    import traceback  # noqa: F401

    _c()
    platform.machine()


def _source_flags(path: str) -> int:
    """The per-mount flags a bind of ``path`` must keep (a user namespace may not clear locked ones)."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME)):
        if f & st:
            out |= ms
    if f & 2048:
        out |= MS_NODIRATIME
    if f & 4096:
        out |= MS_RELATIME
    return out


def _bind(src: str, dst: str, extra: int) -> None:
    _mount(src, dst, None, MS_BIND)
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | _source_flags(src) | extra)


def _drop_capabilities() -> None:
    """Every capability gone: the bounding set, then effective/permitted/inheritable."""
    import ctypes

    for cap in range(64):
        if _c().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _syscall("capset", header, data)


# ---------------------------------------------------------------- one call

JAIL = "/tmp"  # where the server builds the calls' root, in its own mount namespace, before moving into it


def _build_jail(cfg: dict) -> None:
    """Once per server: a private mount namespace whose root is a read-only tmpfs holding the host's /usr (and the
    /bin, /lib* symlinks), the interpreter's lib folder, /dev/{null,zero,urandom}, a /proc and an empty /work;
    then ``pivot_root`` into it and detach the host's tree. The server needs nothing else after start-up; each
    call copies this small tree (cheap) and mounts its own /work and /proc over it."""
    _unshare(SERVER_NAMESPACES)
    _c().sethostname(b"sandbox", 7)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", JAIL, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["read_only"]:  # absolute host paths, seen at the same place inside
        inside = JAIL + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
            _bind(path, inside, MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.mkdir(JAIL + "/dev")
    for dev in ("null", "zero", "urandom"):
        open(f"{JAIL}/dev/{dev}", "w").close()
        _bind(f"/dev/{dev}", f"{JAIL}/dev/{dev}", MS_NOSUID)
    os.mkdir(JAIL + "/work")
    os.mkdir(JAIL + "/proc")
    # the host's proc, under the calls' own: a user namespace may mount a new proc only where a whole one is
    # already visible. Every call mounts its PID namespace's proc over this one before its code runs.
    _mount("/proc", JAIL + "/proc", None, MS_BIND | MS_REC)
    os.chdir(JAIL)
    os.mkdir(".oldroot")
    _syscall("pivot_root", b".", b".oldroot")
    os.chdir("/")
    _check(_c().umount2(b"/.oldroot", MNT_DETACH), "detach the host's tree")
    os.rmdir("/.oldroot")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _reply(rc: int, timed_out: bool, stdout: str = "", stderr: str = "") -> dict:
    return {"rc": rc, "timed_out": timed_out, "stdout": stdout, "stderr": stderr}


def run_call(code: str, timeout_s: float, cfg: dict, ready: "_CallProcess | None" = None) -> dict:
    """One call, isolated as ``cfg["isolation"]`` says (namespaces: in ``ready``, a call process set up ahead, or
    a new one); never raises."""
    try:
        if cfg["isolation"] == "namespaces":
            return (ready or _CallProcess(cfg)).run(code, timeout_s)
        return _call_in_process(code, timeout_s, cfg)
    except Exception as exc:
        return _reply(1, False, stderr=f"sandbox: {type(exc).__name__}: {exc}")


class _CallProcess:
    """The server's handle on one call: a process forked into new mount, PID and IPC namespaces (PID 1 of its PID
    namespace) with a private tmpfs on /work, which drops its privileges, sets its limits and then waits for its
    code on a pipe. The server keeps one ready between calls, so a call waits for none of that set-up.

    One fork per call: the server itself moves into the new namespaces for the fork and straight back
    (``setns`` to the descriptors ``_prepare`` kept), holding on to the call's /work through a descriptor that
    outlives the call's mount namespace; so no supervisor process is needed between the server and the call."""

    def __init__(self, cfg: dict):
        self.read_bytes = cfg["read_bytes"]
        code_r, self.code_w = os.pipe()
        self.work = -1
        try:
            _unshare(CALL_NAMESPACES)  # the server's mount and IPC namespaces, and its next child's PID namespace
            try:
                _mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['work_mb']}m,mode=700")
                if cfg["drop_to"] is not None:
                    os.chown("/work", cfg["drop_to"], cfg["drop_to"])
                self.work = os.open("/work", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                self.pid = os.fork()
                if self.pid == 0:
                    _call_process(code_r, cfg)  # never returns
            finally:
                for flag, fd in cfg["home_namespaces"]:  # back home whatever happened; a server that cannot must stop
                    if _c().setns(fd, flag) != 0:
                        why = os.strerror(__import__("ctypes").get_errno())
                        os.write(2, f"sandbox: could not return to the server's namespace {flag:#x}: {why}\n".encode())
                        os._exit(70)
        except BaseException:
            for fd in (self.code_w, self.work):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            os.close(code_r)

    def run(self, code: str, timeout_s: float) -> dict:
        import time

        deadline = time.monotonic() + timeout_s  # from before the code is sent, as the caller's clock does
        try:
            _write_all(self.code_w, code.encode("utf-8", "surrogatepass"))  # a lone surrogate fails in compile
        except BrokenPipeError:
            pass  # the call process is gone (it could not isolate itself): its exit code and stderr say why
        finally:
            os.close(self.code_w)
        try:
            rc, timed_out = _wait(self.pid, max(0.0, deadline - time.monotonic()), kill=lambda: os.kill(self.pid, 9))
            # PID 1 is gone, so is every process of its namespace; its /work is still open here
            return _reply(rc, timed_out, *_read_outputs(self.work, self.read_bytes))
        finally:
            os.close(self.work)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _become(uid: int) -> None:
    """Switch to ``uid`` (and the same gid, no supplementary groups) for good: root leaves no capability."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies (a killed server takes its call down, and with it the call's
    whole PID namespace). ``parent``: its pid, to catch a parent that died before this line (None inside a new
    PID namespace, where the parent has no pid)."""
    _check(_c().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "pdeathsig")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _call_process(code_fd: int, cfg: dict) -> None:
    """PID 1 of the call's PID namespace: its /proc, no privileges; then the code. Never returns."""
    try:
        _die_with_parent(None)  # the server
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if cfg["drop_to"] is not None:
            _become(cfg["drop_to"])
        else:
            _drop_capabilities()  # root of a user namespace: uid 0 there, no capabilities
        _check(_c().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    except BaseException as exc:
        message = f"sandbox: could not isolate the call: {type(exc).__name__}: {exc}\n".encode()
        try:  # into the call's stderr, so the reply says why
            os.write(os.open("/work/stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), message)
        finally:
            os._exit(125)
    _run_code(code_fd, "/work", cfg)


def _call_in_process(code: str, timeout_s: float, cfg: dict) -> dict:
    import shutil
    import signal
    import tempfile

    work = tempfile.mkdtemp(prefix="rapo_py_")
    try:
        if cfg["drop_to"] is not None:
            os.chown(work, cfg["drop_to"], cfg["drop_to"])
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                _die_with_parent(server)
                os.setsid()
                if cfg["drop_to"] is not None:
                    _become(cfg["drop_to"])
            except BaseException:
                os._exit(125)
            _run_code(code, work, cfg)

        def kill_group():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

        rc, timed_out = _wait(pid, timeout_s, kill=kill_group)
        kill_group()  # whatever it left in its group (a setsid escapes this: the weaker mode)
        return _reply(rc, timed_out, *_read_outputs(work, cfg["read_bytes"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_code(code: "str | int", work: str, cfg: dict) -> None:
    """In the call process, after isolation: limits, private stdio, a clean environment; then the code (``code``,
    or read from the descriptor ``code`` until its end: a spare call process gets this far before its call
    exists), the audit hook, and ``exec``. Never returns."""
    global WORK
    rc = 1
    try:
        import io  # imported by the server already (_preload): free here, and readable whoever we are now
        import resource
        import traceback

        os.chdir(work)
        WORK = _realpath(work)
        cpu, mem, fsize, nproc = (
            cfg["cpu_s"],
            cfg["memory_mb"] << 20,
            int(cfg["file_size_mb"] * (1 << 20)),
            cfg["max_processes"],
        )
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        keep = code if isinstance(code, int) else 65536
        os.closerange(3, keep)  # the server's pipes and anything else inherited
        os.closerange(keep + 1, 65536)
        env = _call_environment(WORK)
        if os.environ != env:  # a namespaces server set it up front (rewriting it here costs ~0.5 ms a call)
            os.environ.clear()
            os.environ.update(env)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        if isinstance(code, int):
            with os.fdopen(code, "rb") as f:
                code = f.read().decode("utf-8", "surrogatepass")
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


def _call_environment(work: str) -> dict:
    """All a call's code sees of the environment: no host variable (secrets) reaches it."""
    return {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _wait(pid: int, timeout_s: float, kill):
    """(exit code as subprocess reports it, timed out?) of the call process; ``kill()`` at the timeout."""
    import select
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
                kill()
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status), True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.002))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _read_outputs(work: "str | int", limit: int) -> tuple[str, str]:
    """The call's stdout and stderr (up to ``limit`` bytes each) from its working folder: a path, or a descriptor
    of the folder."""
    texts = []
    for name in ("stdout.txt", "stderr.txt"):
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=work) if isinstance(work, int) else os.open(_join(work, name), 0)
            with open(fd, "rb") as f:
                texts.append(f.read(limit).decode("utf-8", "replace"))
        except OSError:
            texts.append("")
    return texts[0], texts[1]


# ---------------------------------------------------------------- the server


def _enter_user_namespace() -> None:
    """Unprivileged start: become root of a new user namespace (this uid mapped to 0), which may then create
    the calls' namespaces. Root starts need none."""
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def _prepare(cfg: dict) -> dict:
    cfg = dict(cfg)
    # a user namespace when started unprivileged (or when asked: "always", which tests use to run that path as root)
    _preload()
    userns = cfg["isolation"] == "namespaces" and (os.geteuid() != 0 or cfg.get("user_namespace") == "always")
    if userns:
        _enter_user_namespace()
    # a uid of its own per server (so per running call: a server runs one at a time), not a shared ``nobody``:
    # RLIMIT_NPROC counts per uid, so one call's fork bomb cannot starve another's processes
    cfg["drop_to"] = None if userns or os.geteuid() != 0 else CALL_UID_BASE + os.getpid()
    if cfg["isolation"] == "namespaces":
        base_lib = os.path.join(sys.base_prefix, "lib")
        cfg["read_only"] = [p for p in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin") if os.path.lexists(p)]
        if not any(base_lib == p or base_lib.startswith(p + "/") for p in cfg["read_only"] if not os.path.islink(p)):
            cfg["read_only"].append(base_lib)  # the interpreter's standard library (pyenv, conda: outside /usr)
        _enter_server_pid_namespace()
        _build_jail(cfg)
        os.environ.clear()
        os.environ.update(_call_environment("/work"))  # every call's, set once
        # where _CallProcess returns to after each call's fork (/proc here is the host's, bound in by _build_jail)
        cfg["home_namespaces"] = [
            (flag, os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
            for flag, name in ((CLONE_NEWNS, "mnt"), (CLONE_NEWIPC, "ipc"), (CLONE_NEWPID, "pid"))
        ]
    return cfg


def _enter_server_pid_namespace() -> None:
    """Go on as PID 1 of a PID namespace of this server's own, the parent of every call's. A call's fork needs the
    server's children to go to a new PID namespace and the server's next ones back to its own: ``setns`` may do
    that only with capabilities over the PID namespace, which a server in a user namespace has only over one
    its user namespace owns. The process that started waits here and exits with the server's exit code; a
    server's exit ends every process below it."""
    _unshare(CLONE_NEWPID)
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    _die_with_parent(None)


def serve(cfg: dict) -> None:
    import json

    cfg = _prepare(cfg)
    out = sys.stdout.buffer
    spare = _spare_call(cfg)
    for line in sys.stdin.buffer:
        req = json.loads(line)
        reply = run_call(req["code"], float(req["timeout_s"]), cfg, spare)
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
        spare = _spare_call(cfg)  # the next call's, set up while the caller reads this reply
    # stdin closed: this server exits, and a spare call process with it (PID 1 of the server's PID namespace)


def _spare_call(cfg: dict) -> "_CallProcess | None":
    if cfg["isolation"] != "namespaces":
        return None
    try:
        return _CallProcess(cfg)
    except OSError:  # e.g. no process slot free right now: the next call makes its own
        return None


def once(cfg: dict) -> None:
    import json

    cfg = _prepare(cfg)
    req = json.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(json.dumps(run_call(req["code"], float(req["timeout_s"]), cfg)).encode())


def probe(cfg: dict) -> int:
    try:
        cfg = _prepare(cfg)
    except OSError as exc:
        print(f"cannot set up the server's namespaces: {exc}")
        return 1
    reply = run_call("print(1)", 10.0, cfg)
    if reply["rc"] == 0 and reply["stdout"].strip() == "1":
        return 0
    print((reply["stderr"] or reply["stdout"] or f"exit code {reply['rc']}").strip().splitlines()[-1])
    return 1


if __name__ == "__main__":
    import json

    mode, config = sys.argv[1], json.loads(sys.argv[2])
    if mode == "--serve":
        serve(config)
    elif mode == "--once":
        once(config)
    elif mode == "--probe":
        sys.exit(probe(config))
    else:
        sys.exit(f"sandbox_runner: unknown mode {mode!r} (--serve, --once, --probe)")
