"""Runs the model's python code in a call of its own, isolated by the operating system. Started by
``rapo_ray/envs/tools.py`` as ``python -I -S sandbox_runner.py MODE CONFIG`` (standard library only):

    --serve   a fork server: one JSON request per line on stdin ({"code", "timeout_s"}), one JSON reply per
              line on stdout ({"rc", "timed_out", "stdout", "stderr"}); a call costs forks, not a python start
    --once    the same for one request, then exit (rollout.python_sandbox=subprocess)
    --probe   set up one isolated call running ``print(1)``; exit 0 if that works, else print why and exit 1

Both modes run a call through ``run_call``: the same code, so the same result for the same program.

isolation "namespaces" (the default).
  server      at start: new mount, network (no interfaces), UTS and cgroup namespaces; builds the calls' root on
              a tmpfs (the host's /usr, /lib*, /bin symlinks and the python's lib folder read-only, /dev/{null,
              zero,urandom}, /proc, an empty /work), pivot_roots into it and detaches the host's tree. Started
              unprivileged, it first enters a user namespace.
  supervisor  per call, forked from the server: new mount, PID and IPC namespaces; a size-limited tmpfs on
              /work (the only writable place); forks the call process and waits for it (killing it at the
              timeout); reads the output from /work; exits, which frees every mount of the call.
  call        PID 1 of the new PID namespace: mounts its /proc, drops to a uid of its own (as root) or every
              capability (in a user namespace), sets no_new_privs and the rlimits, closes inherited
              descriptors, runs the code. When it ends, however it ends, the kernel kills every process left
              in its PID namespace: nothing a call starts outlives it.
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
SERVER_NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWCGROUP
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


def run_call(code: str, timeout_s: float, cfg: dict, supervisor: "_Supervisor | None" = None) -> dict:
    """One call, isolated as ``cfg["isolation"]`` says (namespaces: in ``supervisor``, a ready one, or a new
    one); never raises."""
    try:
        if cfg["isolation"] == "namespaces":
            return (supervisor or _Supervisor(cfg)).run(code, timeout_s)
        return _call_in_process(code, timeout_s, cfg)
    except Exception as exc:
        return _reply(1, False, stderr=f"sandbox: {type(exc).__name__}: {exc}")


class _Supervisor:
    """A forked process that makes a call's namespaces and /work, then waits for the call's code. The server
    keeps one ready between calls, so a call does not wait for that set-up. Never returns into the server."""

    def __init__(self, cfg: dict):
        import json

        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        server = os.getpid()
        self.pid = os.fork()
        if self.pid:
            os.close(req_r)
            os.close(rep_w)
            return
        try:
            _die_with_parent(server)
            os.close(self.req_w)
            os.close(self.rep_r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # the server's request and reply pipes are the server's alone
            os.dup2(null, 1)
            try:
                _enter_call_namespaces(cfg)
                not_ready = None
            except BaseException as exc:
                not_ready = f"sandbox: {type(exc).__name__}: {exc}"
            with os.fdopen(req_r, "rb") as f:
                raw = f.read()
            if not raw:  # the server closed without a call for us
                os._exit(0)
            req = json.loads(raw)
            try:
                if not_ready:
                    raise RuntimeError(not_ready)
                reply = _supervise(req["code"], float(req["timeout_s"]), cfg)
            except BaseException as exc:
                reply = _reply(1, False, stderr=f"sandbox: {type(exc).__name__}: {exc}")
            data = json.dumps(reply).encode()
            while data:
                data = data[os.write(rep_w, data) :]
        finally:
            os._exit(0)

    def run(self, code: str, timeout_s: float) -> dict:
        import json

        try:
            data = json.dumps({"code": code, "timeout_s": timeout_s}).encode()
            while data:
                data = data[os.write(self.req_w, data) :]
        finally:
            os.close(self.req_w)
        with os.fdopen(self.rep_r, "rb") as f:
            raw = f.read()
        _, status = os.waitpid(self.pid, 0)
        if not raw:
            return _reply(1, False, stderr=f"sandbox: the call's supervisor died (status {status})")
        return json.loads(raw)


def _become(uid: int) -> None:
    """Switch to ``uid`` (and the same gid, no supplementary groups) for good: root leaves no capability."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies (a killed server takes its call down, and a killed supervisor
    the call's whole PID namespace). ``parent``: its pid, to catch a parent that died before this line (None
    inside a new PID namespace, where the parent has no pid)."""
    _check(_c().prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "pdeathsig")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _enter_call_namespaces(cfg: dict) -> None:
    _unshare(CALL_NAMESPACES)
    _mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['work_mb']}m,mode=700")
    if cfg["drop_to"] is not None:
        os.chown("/work", cfg["drop_to"], cfg["drop_to"])


def _supervise(code: str, timeout_s: float, cfg: dict) -> dict:
    """In the supervisor, inside the call's namespaces: run the call process, then read its output."""
    pid = os.fork()
    if pid == 0:
        _call_process(code, cfg)  # never returns
    rc, timed_out = _wait(pid, timeout_s, kill=lambda: os.kill(pid, 9))  # PID 1 dies: its namespace dies with it
    return _reply(rc, timed_out, *_read_outputs("/work", cfg["read_bytes"]))


def _call_process(code: str, cfg: dict) -> None:
    """PID 1 of the call's PID namespace: its /proc, its hostname, no privileges; then the code. Never returns."""
    try:
        _die_with_parent(None)  # the supervisor
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if cfg["drop_to"] is not None:
            _become(cfg["drop_to"])
        else:
            _drop_capabilities()  # root of a user namespace: uid 0 there, no capabilities
        _check(_c().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    except BaseException as exc:
        try:
            os.write(2, f"sandbox: could not isolate the call: {exc}\n".encode())
        finally:
            os._exit(125)
    _run_code(code, "/work", cfg)


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


def _run_code(code: str, work: str, cfg: dict) -> None:
    """In the call process, after isolation: limits, private stdio, the audit hook, then the code. Never
    returns."""
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
        os.closerange(3, 65536)  # the server's pipes and anything else inherited
        os.environ.clear()
        os.environ.update({"HOME": WORK, "TMPDIR": WORK, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
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


def _read_outputs(work: str, limit: int) -> tuple[str, str]:
    texts = []
    for name in ("stdout.txt", "stderr.txt"):
        try:
            with open(os.path.join(work, name), "rb") as f:
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
        _build_jail(cfg)
    return cfg


def serve(cfg: dict) -> None:
    import json

    cfg = _prepare(cfg)
    out = sys.stdout.buffer
    spare = _spare_supervisor(cfg)
    for line in sys.stdin.buffer:
        req = json.loads(line)
        reply = run_call(req["code"], float(req["timeout_s"]), cfg, spare)
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
        spare = _spare_supervisor(cfg)  # the next call's, set up while the caller reads this reply


def _spare_supervisor(cfg: dict) -> "_Supervisor | None":
    if cfg["isolation"] != "namespaces":
        return None
    try:
        return _Supervisor(cfg)
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
        print(f"cannot create a user namespace: {exc}")
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
