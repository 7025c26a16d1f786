"""The python tool in its child processes: hostile programs are contained, a private directory per call, a dead
fork server is replaced, and lexical search gives the same results in every process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rapo_ray.envs.tools import PythonSandbox, SandboxLimits

HOSTILE = {
    "infinite loop": "while True: pass",
    "fork bomb": "import os\nwhile True: os.fork()",
    "10 GB allocation": "x = bytearray(10 * 1024**3)",
    "socket": "import socket\ns = socket.create_connection(('127.0.0.1', 9))",
    "write outside": "open('/tmp/rapo_sandbox_escape.txt', 'w').write('x')",
    "100 MB output": "import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))",
    "subprocess": "import subprocess; subprocess.run(['touch', '/tmp/rapo_sandbox_escape2'])",
}


def test_lexical_search_is_the_same_in_every_process(tiny_cfg):
    """Rollout workers are separate processes with their own string-hash seeds; a query with tied documents
    ("rival of neighbor of X" matches many facts equally) must still get one answer everywhere."""
    import subprocess
    import sys

    code = (
        "from rapo_ray.envs import tasks as b\nfrom rapo_ray.envs.tools import LexicalIndex\n"
        f"idx = LexicalIndex(b.make_world({tiny_cfg.tasks.seed}).documents())\n"
        "print([d for d, _ in idx.search('rival of neighbor of Losi', 3)])\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in range(6)
    }
    assert len(outs) == 1, outs


@pytest.mark.parametrize("mode", PythonSandbox.MODES)
def test_sandbox_contains_hostile_programs(mode):
    sb = PythonSandbox(SandboxLimits(timeout_s=2.0, cpu_s=2, output_chars=200), max_concurrency=4, mode=mode)
    try:
        futures = {name: sb.submit(code) for name, code in HOSTILE.items()}
        benign = [sb.submit(f"print({i} * 7)") for i in range(6)]
        for name, fut in futures.items():
            res = fut.result(timeout=30)
            assert not res.ok and res.text.startswith("Error"), (name, res.text)
            assert res.elapsed_s < 5.0, name
            assert len(res.text) <= 200 + len("...(truncated)") + 40
        assert [f.result().text for f in benign] == [str(i * 7) for i in range(6)]
        assert not Path("/tmp/rapo_sandbox_escape.txt").exists() and not Path("/tmp/rapo_sandbox_escape2").exists()
        assert sb.run("print('still alive')").text == "still alive"
    finally:
        sb.close()


@pytest.mark.parametrize("mode", PythonSandbox.MODES)
def test_sandbox_private_dir_and_errors(mode):
    sb = PythonSandbox(max_concurrency=1, mode=mode)
    assert sb.run("open('a.txt','w').write('hi')\nprint(open('a.txt').read())").text == "hi"
    assert sb.run("print(open('a.txt').read())").text.startswith(
        "Error: FileNotFoundError"
    )  # a fresh directory per call
    assert sb.run("x = 5").text == "" and "NameError" in sb.run("print(x)").text  # no state carried between calls
    assert sb.run("   ").text == "Error: empty code"
    assert "ZeroDivisionError" in sb.run("1/0").text
    assert "SyntaxError" in sb.run("def (").text
    assert sb.run("import sys; print('bye'); sys.exit(3)").text == "Error: exit code 3"
    with pytest.raises(ValueError, match="valid: fork_server, subprocess"):
        PythonSandbox(mode="docker")
    sb.close()


def test_sandbox_fork_server_replaced_after_it_dies():
    """A server that died while idle is replaced before the call; one that fails a call is discarded and
    that call (only) gets an error result."""
    import os
    import signal

    sb = PythonSandbox(max_concurrency=1)
    try:
        assert sb.run("print(1)").text == "1"
        (server,) = sb._servers
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server dies between calls
        server.proc.wait()
        assert sb.run("print(2)").text == "2" and sb._servers and sb._servers[0] is not server
        (server,) = sb._servers
        server.call = lambda code, timeout_s: (_ for _ in ()).throw(RuntimeError("did not answer"))  # hangs mid-call
        res = sb.run("print(3)")
        assert not res.ok and res.text == "Error: sandbox failure: RuntimeError: did not answer" and not sb._servers
        assert sb.run("print(4)").text == "4"
    finally:
        sb.close()
