"""Tools the agent calls: a sandboxed python interpreter and search over a document corpus.

A tool never raises on the model's input: every failure (timeout, crash, empty code, no hits) comes back
as a ``ToolResult`` with ``ok=False`` and a short error text, which the loop shows the model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from rapo_ray.core.errors import SandboxUnavailable
from rapo_ray.envs import rewards
from rapo_ray.types.environment import ToolResult

RUNNER = Path(__file__).with_name("sandbox_runner.py")
log = logging.getLogger("rapo_ray.sandbox")


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC (enforced for the unprivileged user)
    file_size_mb: float = 1.0  # RLIMIT_FSIZE: bounds stdout and any file the code writes
    work_mb: int = 16  # the call's private tmpfs (namespaces isolation): all its files together
    output_chars: int = 512  # what the model sees


_PROBED: dict[tuple, str] = {}  # (euid, config) -> "" (works) or why not: probed once per process


class PythonSandbox:
    """Runs model-written python in a call of its own; a thread pool runs calls concurrently.

    ``isolation="namespaces"`` (default): every call gets its own PID, mount and IPC namespaces (network, UTS
    and cgroup ones per server), a root of its own (the host's /usr and python library read-only, a private
    tmpfs /work), and runs under a uid of its own (or capability-less in a user namespace when not started as
    root). When the call returns, every process it started is gone and nothing it wrote is left
    (rapo_ray/envs/sandbox_runner.py; docs/SANDBOX.md says what is and is not guaranteed). A machine that
    refuses namespaces gets ``SandboxUnavailable`` at construction, naming what is missing.
    ``isolation="process"`` is the opt-in weaker mode for such machines (rlimits, a private host folder, a uid of
    its own when root, the audit hook, a process-group kill after each call), announced in the log.

    ``mode="fork_server"`` (default) keeps server processes that fork each call; ``mode="subprocess"`` starts
    a python per call (~50 ms more). Both run a call through the same code and give the same results.
    """

    MODES = ("fork_server", "subprocess")
    ISOLATIONS = ("namespaces", "process")

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        max_concurrency: int = 4,
        mode: str = "fork_server",
        isolation: str = "namespaces",
    ):
        if mode not in self.MODES:
            raise ValueError(f"python sandbox mode {mode!r}; valid: {', '.join(self.MODES)}")
        if isolation not in self.ISOLATIONS:
            raise ValueError(f"python sandbox isolation {isolation!r}; valid: {', '.join(self.ISOLATIONS)}")
        self.limits = limits or SandboxLimits()
        self.mode, self.isolation = mode, isolation
        self._config = self._runner_config()
        if isolation == "namespaces":
            self._require_namespaces()
        else:
            log.warning(
                "python sandbox: isolation=process (opt-in, weaker): a call shares this machine's process, "
                "mount and network view; a process it detaches with setsid can outlive it"
            )
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="pysandbox")
        self._lock = threading.Lock()
        self._idle_servers: list[_ForkServer] = []
        self._servers: list[_ForkServer] = []
        self._closed = False

    def _runner_config(self) -> str:
        lim = self.limits
        return json.dumps(
            {
                "isolation": self.isolation,
                "cpu_s": lim.cpu_s,
                "memory_mb": lim.memory_mb,
                "file_size_mb": lim.file_size_mb,
                "max_processes": lim.max_processes,
                "work_mb": max(lim.work_mb, math.ceil(lim.file_size_mb * 2) + 1),
                "read_bytes": lim.output_chars * 4 + 1024,
            }
        )

    def _command(self, flag: str) -> list[str]:
        return [sys.executable, "-I", "-S", str(RUNNER), flag, self._config]

    def _require_namespaces(self) -> None:
        key = (os.geteuid(), self._config)
        if key not in _PROBED:
            proc = subprocess.run(self._command("--probe"), capture_output=True, text=True, env=self._env(), timeout=60)
            _PROBED[key] = "" if proc.returncode == 0 else (proc.stdout + proc.stderr).strip() or "unknown error"
        if _PROBED[key]:
            raise SandboxUnavailable(
                f"python sandbox: this machine refused the namespaces a call runs in ({_PROBED[key]}). Run as root, "
                "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu "
                "24.04+ also kernel.apparmor_restrict_unprivileged_userns=0), or opt into the weaker "
                "rollout.python_isolation=process"
            )

    def run(self, code: str) -> ToolResult:
        import time

        t0 = time.perf_counter()
        if not code or not code.strip():
            return ToolResult("Error: empty code", False, 0.0)
        try:
            run_once = self._run_forked if self.mode == "fork_server" else self._run_subprocess
            rc, timed_out, stdout, stderr = run_once(code)
        except Exception as exc:  # the host must survive anything the tool does
            return ToolResult(f"Error: sandbox failure: {type(exc).__name__}: {exc}", False, time.perf_counter() - t0)
        elapsed = time.perf_counter() - t0
        if timed_out:
            return ToolResult(f"Error: timed out after {self.limits.timeout_s:g} s", False, elapsed)
        if rc == -signal.SIGXFSZ:
            return ToolResult(self._cut(stdout) + "\nError: output limit exceeded", False, elapsed)
        if rc == -signal.SIGXCPU or rc == -signal.SIGKILL:
            return ToolResult(f"Error: CPU time limit ({self.limits.cpu_s} s) exceeded", False, elapsed)
        if rc != 0:
            last = [ln for ln in stderr.strip().splitlines() if ln.strip()]
            msg = last[-1] if last else f"exit code {rc}"
            if "[Errno 27]" in msg:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
                msg = f"output limit exceeded ({self.limits.file_size_mb:g} MB)"
            return ToolResult(self._cut(f"Error: {msg}"), False, elapsed)
        return ToolResult(self._cut(stdout.rstrip("\n")), True, elapsed)

    def _run_subprocess(self, code: str) -> tuple[int, bool, str, str]:
        proc = subprocess.Popen(
            self._command("--once"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env(),
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        request = json.dumps({"code": code, "timeout_s": self.limits.timeout_s}).encode()
        try:
            # the runner enforces the timeout on the call; this one only guards against a hung runner
            out, err = proc.communicate(request, timeout=self.limits.timeout_s + 10)
        except subprocess.TimeoutExpired:
            self._kill_group(proc)
            proc.wait()
            raise RuntimeError(f"python sandbox runner (pid {proc.pid}) did not answer") from None
        if proc.returncode != 0 or not out:
            raise RuntimeError(f"python sandbox runner exited {proc.returncode}: {err.decode(errors='replace')[-300:]}")
        reply = json.loads(out)
        return reply["rc"], reply["timed_out"], reply["stdout"], reply["stderr"]

    def _run_forked(self, code: str) -> tuple[int, bool, str, str]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            server = self._idle_servers.pop() if self._idle_servers else None
            if server is not None and server.proc.poll() is not None:  # died while idle: replace it
                self._servers.remove(server)
                server = None
        if server is None:
            server = _ForkServer(self._command("--serve"), self._env())
            with self._lock:
                self._servers.append(server)
        try:
            reply = server.call(code, self.limits.timeout_s)
        except Exception:
            server.kill()  # a server that broke protocol or hung is not reused
            with self._lock:
                if server in self._servers:  # close() may have dropped it already
                    self._servers.remove(server)
            raise
        with self._lock:
            self._idle_servers.append(server)
        return reply["rc"], reply["timed_out"], reply["stdout"], reply["stderr"]

    @staticmethod
    def _env() -> dict:
        return {"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}

    def submit(self, code: str):
        return self.pool.submit(self.run, code)

    def _cut(self, text: str) -> str:
        n = self.limits.output_chars
        return text if len(text) <= n else text[:n] + "...(truncated)"

    @staticmethod
    def _kill_group(proc):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def score(self, generated_text: str, answers, kind: str, tool_bonus: float = 0.0) -> rewards.Score:
        return rewards.score(generated_text, answers, kind, tool_bonus)

    def close(self):
        self.pool.shutdown(wait=True)
        with self._lock:
            self._closed = True
            servers, self._servers, self._idle_servers = self._servers, [], []
        for server in servers:
            server.kill()


class _ForkServer:
    """One ``sandbox_runner.py --serve`` process: one call at a time, JSON lines over its stdin/stdout."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )

    def call(self, code: str, timeout_s: float) -> dict:
        import json
        import select

        self.proc.stdin.write(json.dumps({"code": code, "timeout_s": timeout_s}).encode() + b"\n")
        self.proc.stdin.flush()
        # the server enforces the timeout on its child; this one only guards against a hung server
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s + 10)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(
                f"python sandbox server (pid {self.proc.pid}) did not answer (exit code {self.proc.poll()})"
            )
        return json.loads(line)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


# ---------------------------------------------------------------- search


class DocumentIndex(Protocol):
    def search(self, query: str, k: int) -> list[tuple[str, float]]: ...


_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    """Unigrams plus adjacent-word bigrams, so word order counts ("of X" differs from "X is")."""
    w = _WORD.findall(text.lower())
    return w + [f"{a}_{b}" for a, b in zip(w, w[1:])]


class LexicalIndex:
    """In-memory TF-IDF index: the search tool's default for the bundled corpus and for tests.

    The Milvus-backed dense index (rapo_ray.retrieval) implements the same ``search(query, k)``.
    """

    def __init__(self, documents: Sequence[str]):
        if not documents:
            raise ValueError("LexicalIndex needs at least one document")
        self.documents = list(documents)
        self._tf = [Counter(_words(d)) for d in self.documents]
        df = Counter(w for tf in self._tf for w in tf)
        n = len(self.documents)
        self._idf = {w: math.log(1 + n / c) for w, c in df.items()}
        self._postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self._tf):
            for w in tf:
                self._postings.setdefault(w, []).append(i)

    def search(self, query: str, k: int = 3) -> list[tuple[str, float]]:
        # Sorted words and an explicit (score, document order) ranking: a set's order follows the per-process
        # string hash seed, which changed float sums and tie order between processes (rollout workers
        # returned different results for one query, so runs were not reproducible).
        scores: dict[int, float] = {}
        for w in sorted(set(_words(query))):
            for i in self._postings.get(w, ()):
                scores[i] = scores.get(i, 0.0) + self._idf[w]
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [(self.documents[i], s) for i, s in best]


class SearchTool:
    def __init__(self, index: DocumentIndex, top_k: int = 3, output_chars: int = 512):
        self.index, self.top_k, self.output_chars = index, top_k, output_chars

    def run(self, query: str) -> ToolResult:
        if not query or not query.strip():
            return ToolResult("Error: empty query", False)
        try:
            hits = self.index.search(query.strip(), self.top_k)
        except Exception as exc:
            return ToolResult(f"Error: search failed: {type(exc).__name__}: {exc}", False)
        if not hits:
            return ToolResult("No results.", True)
        text = "\n".join(doc for doc, _ in hits)
        return ToolResult(text[: self.output_chars], True)


class ToolSet:
    """The agent's ``Environment`` (rapo_ray/types/environment.py): the tools by tag name, with a shared pool so
    calls in one batch run concurrently, and the reward rules of rapo_ray.envs.rewards."""

    def __init__(self, python: PythonSandbox | None = None, search: SearchTool | None = None, max_concurrency: int = 4):
        self.python, self.search = python, search
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="tools")

    def call(self, tool: str, content: str) -> ToolResult:
        if tool == "python" and self.python is not None:
            return self.python.run(content)
        if tool == "search" and self.search is not None:
            return self.search.run(content)
        return ToolResult(f"Error: tool {tool!r} is not available", False)

    def submit(self, tool: str, content: str) -> Future:
        """Run one call on the shared pool; the future resolves to its ``ToolResult``."""
        return self.pool.submit(self.call, tool, content)

    def call_many(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        futures = [self.submit(tool, content) for tool, content in calls]
        return [f.result() for f in futures]

    def score(self, generated_text: str, answers, kind: str, tool_bonus: float = 0.0) -> rewards.Score:
        return rewards.score(generated_text, answers, kind, tool_bonus)

    def close(self):
        self.pool.shutdown(wait=True)
        if self.python is not None:
            self.python.close()
