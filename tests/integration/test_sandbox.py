"""The python tool's OS isolation, tried as a hostile user would."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from rapo_ray.core.errors import SandboxUnavailable
from rapo_ray.envs.sandbox_runner import CALL_UID_BASE
from rapo_ray.envs.tools import PythonSandbox, SandboxLimits

LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2, output_chars=200)


MARGIN_S = 2.5  # the call's limit plus this is the most a hostile call may take


SECRET = "hunter2-rapo-secret"


# Process creation that raises no audit event: the route an audit-hook sandbox never sees. (3.11's signature.)
SPAWN = """
import _posixsubprocess, os
def spawn(*argv, setsid=True):
    r, w = os.pipe()
    return _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, False, setsid, -1, None, None, None, -1, None, False)
"""


# name -> (code, expected result: "ok" / "error" / an exact text)
HOSTILE = {
    "infinite loop": ("while True: pass", "error"),
    "fork bomb (os.fork)": ("import os\nwhile True: os.fork()", "error"),
    "fork bomb (no audit event)": (SPAWN + "while True: spawn('/usr/bin/sleep', '31337')", "error"),
    "setsid daemon": (SPAWN + "print(spawn('/usr/bin/sleep', '31337') > 0)", "True"),
    "double fork": (SPAWN + "spawn('/bin/sh', '-c', '(sleep 31337 &) ; (sleep 31337 &)')\nprint('forked')", "forked"),
    "output planter": (
        SPAWN + "spawn('/bin/sh', '-c', 'while true; do for f in /tmp/rapo_py_*/stdout.txt /work/stdout.txt; "
        "do echo PLANTED > $f; done 2>/dev/null; done')\nprint('planted')",
        "ok",  # its own output races its own planter; what matters is the calls after it
    ),
    "kill every process it can": (SPAWN + "spawn('/bin/kill', '-9', '-1')\nimport time; time.sleep(0.3)", "ok"),
    "signal the parent": ("import os; os.kill(os.getppid(), 9)", "error"),
    "host /proc": ("import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", "[1]"),
    "environment secrets": (
        "import os\ndef read(p):\n    try:\n        return open(p, 'rb').read()\n    except OSError:\n        return b''\n"
        "print(sum(read(f'/proc/{p}/environ').count(b'hunter2') for p in ('self', '1')), "
        "sum('hunter2' in v for v in os.environ.values()))",
        "0 0",
    ),
    "network interfaces": (
        "print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])",
        "['lo']",
    ),
    "socket": ("import socket\ns = socket.create_connection(('127.0.0.1', 9))", "error"),
    "write outside": ("open('/tmp/rapo_sandbox_escape.txt', 'w').write('x')", "error"),
    "read host files": ("print(open('/etc/hostname').read())", "error"),
    "10 GB allocation": ("x = bytearray(10 * 1024**3)", "error"),
    "disk exhaustion": ("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 1000000)\n    i += 1", "error"),
    "100 MB output": ("import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))", "error"),
    "non-encodable output": ("print('\\udcff')", "error"),
    "deep recursion": ("def f(): return f()\nf()", "error"),
    "stdin": ("print(input())", "error"),
}


# results that depend on timing (which limit stops a loop first; a planter racing its own output): compare ok only
RACES = {"infinite loop", "output planter"}


def _call_processes() -> set[int]:
    """PIDs of live processes a call of this session could have left: anything under a call uid whose server is
    this process's (or gone), or running ``sleep 31337``, except a server's spare (the next call's process, made
    ahead, waiting for its code: a child of a server). A call's own processes are never a server's children: its
    PID 1 is reaped before its reply, and everything else it starts lives below that PID 1. Calls of another
    process's servers (a background job of this session, tests/background.py) are not this test's."""

    def status_of(pid) -> str:
        return Path(f"/proc/{pid}/status").read_text()

    def is_server(pid) -> bool:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"sandbox_runner.py" in cmd and _uid(status_of(pid)) < CALL_UID_BASE

    def ours(server_pid: int) -> bool:
        pid = server_pid
        while pid > 1:
            try:
                pid = int(status_of(pid).split("\nPPid:")[1].split()[0])
            except (OSError, IndexError, ValueError):
                return pid == server_pid  # a server that is gone: its calls must be gone too
            if pid == os.getpid():
                return True
        return False

    out = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            status = status_of(p.name)
            uid = _uid(status)
            cmd = (p / "cmdline").read_bytes()
            if "\nState:\tZ" in status:  # dead, waiting for its (re)parent to reap it
                continue
            if b"31337" in cmd or (uid >= CALL_UID_BASE and ours(uid - CALL_UID_BASE)):
                if not is_server(status.split("\nPPid:")[1].split()[0]):
                    out.add(int(p.name))
        except (OSError, IndexError):
            continue
    return out


def _uid(status: str) -> int:
    return int(status.split("\nUid:")[1].split()[0])


def _training_tools(mode):
    from rapo_ray.config import Config
    from rapo_ray.envs.suite import build_tools

    cfg = Config()
    cfg.rollout.python_sandbox, cfg.rollout.tool_timeout_s = mode, LIMITS.timeout_s
    return build_tools(cfg.tasks, cfg.rollout, search_index=None, max_concurrency=4)


def _serving_tools(mode):
    from rapo_ray.config import Config
    from rapo_ray.serving.app import _make_tools

    cfg = Config()
    cfg.rollout.python_sandbox, cfg.rollout.tool_timeout_s = mode, LIMITS.timeout_s
    return _make_tools(cfg)


def _expect(name, expected, res):
    if expected == "error":
        assert not res.ok and res.text.startswith("Error"), (name, res.text)
    elif expected == "ok":
        assert res.ok, (name, res.text)
    else:
        assert res.ok and res.text == expected, (name, res.text)


@pytest.mark.skipif(os.geteuid() != 0, reason="the call-uid process check needs root (CI runs as root)")
@pytest.mark.parametrize("tools_of", [_training_tools, _serving_tools], ids=["training", "serving"])
def test_hostile_suite_in_every_mode_gives_the_same_results(tools_of, monkeypatch):
    monkeypatch.setenv("RAPO_TEST_SECRET", SECRET)
    before = _call_processes()
    results = {}
    for mode in PythonSandbox.MODES:
        tools = tools_of(mode)
        try:
            futures = {name: tools.submit("python", code) for name, (code, _) in HOSTILE.items()}
            benign = [tools.submit("python", f"print({i} * 7)") for i in range(8)]
            results[mode] = {}
            for name, fut in futures.items():
                res = fut.result(timeout=60)
                _expect(name, HOSTILE[name][1], res)
                assert res.elapsed_s < LIMITS.timeout_s + MARGIN_S, (name, res.elapsed_s)
                results[mode][name] = (res.ok, res.text if name not in RACES else None)
            assert [f.result().text for f in benign] == [str(i * 7) for i in range(8)]
            # after every hostile call returned: nothing of theirs runs, nothing planted reaches later calls
            assert _call_processes() <= before, _call_processes() - before
            later = [tools.call("python", f"print('later', {i})").text for i in range(20)]
            assert later == [f"later {i}" for i in range(20)]
        finally:
            tools.close()
        assert not Path("/tmp/rapo_sandbox_escape.txt").exists()
    assert results["fork_server"] == results["subprocess"]  # one result contract for both modes


def test_a_call_cannot_see_another_call_while_it_runs():
    sb = PythonSandbox(LIMITS, max_concurrency=2)
    try:
        writer = sb.submit("import time\nopen('mine.txt', 'w').write('secret-of-call-a')\ntime.sleep(1.0)")
        time.sleep(0.3)
        probe = sb.run(
            "import os, glob\n"
            "seen = glob.glob('/tmp/**/mine.txt', recursive=True) + glob.glob('/work/*')\n"
            "cwds = [os.readlink(f'/proc/{p}/cwd') for p in os.listdir('/proc') if p.isdigit()]\n"
            "print(seen, cwds)"
        )
        assert probe.ok and "mine.txt" not in probe.text and "secret" not in probe.text, probe.text
        assert writer.result(timeout=10).ok
    finally:
        sb.close()


def test_a_call_that_breaks_its_server_costs_only_that_call():
    """A server that dies or hangs mid-call is replaced; the call gets an error, nothing is left behind."""
    before = _call_processes()
    sb = PythonSandbox(LIMITS, max_concurrency=1)
    try:
        assert sb.run("print(1)").text == "1"
        (server,) = sb._servers
        killer = threading.Timer(0.3, lambda: os.kill(server.proc.pid, 9))  # the server dies while a call runs
        killer.start()
        res = sb.run("import time; time.sleep(2); print('never')")
        assert not res.ok and "did not answer" in res.text and server not in sb._servers
        assert res.elapsed_s < 1.5  # the call died with its server: nobody waited for its sleep
        assert sb.run("print(2)").text == "2"
        assert not list(Path("/tmp").glob("rapo_py_*"))  # namespaces mode writes nothing to the host's /tmp
        assert _call_processes() <= before  # the killed server's call (and its sleep) went with it
    finally:
        sb.close()


def test_process_isolation_is_opt_in_and_announced(caplog):
    with caplog.at_level("WARNING", logger="rapo_ray.sandbox"):
        sb = PythonSandbox(LIMITS, max_concurrency=1, isolation="process")
    try:
        assert "isolation=process (opt-in, weaker)" in caplog.text
        assert sb.run("print(6 * 7)").text == "42"
    finally:
        sb.close()
    with pytest.raises(ValueError, match="valid: namespaces, process"):
        PythonSandbox(isolation="none")


def test_a_machine_without_namespaces_gets_a_clear_error(monkeypatch):
    """Where the kernel refuses namespaces the sandbox refuses to start (no silent fallback), and says what to
    do. Simulated: the probe's answer is what a container without CAP_SYS_ADMIN answers."""
    import rapo_ray.envs.tools as tools

    sb = PythonSandbox(LIMITS, max_concurrency=1)
    key = (os.geteuid(), sb._config)
    sb.close()
    monkeypatch.setitem(tools._PROBED, key, "unshare(0x7e020000): Operation not permitted")
    with pytest.raises(SandboxUnavailable, match=r"Operation not permitted.*rollout.python_isolation=process"):
        PythonSandbox(LIMITS, max_concurrency=1)


def test_the_user_namespace_path_isolates_the_same_way():
    """Started unprivileged, the runner enters a user namespace first and the call drops every capability
    instead of switching to nobody. ``user_namespace: always`` runs that path here whoever we are."""
    import json
    import subprocess

    sb = PythonSandbox(LIMITS)
    config = json.dumps({**json.loads(sb._config), "user_namespace": "always"})
    command = sb._command("--once")[:-1] + [config]
    sb.close()
    code = (
        "import os\n"
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "print(os.getpid(), caps, 'etc' in os.listdir('/'), open('/proc/net/dev').read().count(':'))"
    )
    proc = subprocess.run(
        command, input=json.dumps({"code": code, "timeout_s": 5}), capture_output=True, text=True, timeout=60
    )
    if f"unshare({0x10000000:#x})" in proc.stderr:  # CLONE_NEWUSER refused: root runs need none, so skip
        pytest.skip("this kernel refuses user namespaces")
    reply = json.loads(proc.stdout)
    assert reply["rc"] == 0 and reply["stdout"].split() == ["1", "0000000000000000", "False", "1"], reply
