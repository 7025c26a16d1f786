"""README's cluster path as a user runs it: ``ray start --head`` on this 2-CPU box, then a job submitted with the Job
SDK (what ``ray job submit`` calls). The default job asks for 4 CPUs (2 learners + 2 rollout workers at 1 CPU each);
on a 2-CPU head it must fit itself (``resources.fit_cpus``), say so, and succeed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rapo_ray.config import TINY_OVERRIDES, TINY_WARM_OVERRIDES
from rapo_ray.core.net import free_port, short_temp_dir
from rapo_ray.launch.ray_reaper import reap

REPO = Path(__file__).resolve().parents[2]
BUFFER_COLLECTION = "submitted_job_steps"  # the job's own buffer, beside the warm artifacts' default one


@pytest.fixture
def two_cpu_head():
    """A Ray head started by ``ray start --head`` with 2 CPUs on 127.0.0.1 (its own temp folder and ports); every
    process of its session is ended afterwards (by that folder, never ``ray stop``: other Rays may be running)."""
    temp = Path(short_temp_dir("rj"))  # Ray's socket paths live under it
    bin_dir = Path(sys.executable).parent
    env = os.environ | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_TMPDIR": str(temp),
        # keep 127.0.0.1 as the node's address (Ray on Linux swaps it for the machine's own by default)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    dashboard = free_port()
    cmd = [
        str(bin_dir / "ray"),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--port={free_port()}",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",  # not the fixed defaults: another Ray may hold them
        f"--ray-client-server-port={free_port()}",
        "--num-cpus=2",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dashboard}", env, temp
    finally:
        sessions = sorted(p for p in temp.glob("session_*") if p.is_dir() and not p.is_symlink())
        for session in sessions:
            reap(str(session))


def agent_logs(temp: Path) -> str:
    """The tail of the head's dashboard-agent logs: why its job agent did not come up."""
    logs = sorted(temp.glob("session_*/logs/dashboard_agent*")) + sorted(temp.glob("session_*/logs/raylet.out"))
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:] for p in logs) or f"no logs under {temp}"


@pytest.mark.slow
def test_a_job_submitted_to_a_two_cpu_head_fits_itself_and_succeeds(two_cpu_head, tiny_warm_artifacts, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from rapo_ray.launch.launcher import enable_token_auth_if_available

    address, env, temp = two_cpu_head
    enable_token_auth_if_available()  # Ray 2.60 heads started here use token auth (README): send the token
    overrides = [
        *TINY_OVERRIDES,
        # the session's tiny warm start (the chaos job's and the trainer tests', usually built by now: found cached)
        *TINY_WARM_OVERRIDES,
        f"run.artifacts_dir={tiny_warm_artifacts}",
        # the default shares, 1 CPU per learner and per worker, which a 2-CPU head cannot give
        "resources.cpus_per_learner=1.0",
        "resources.cpus_per_rollout_worker=1.0",
        # RAPO, the default: a buffer of its own is built on the 2-CPU head, then the Serve retrieval app and hybrid
        # slots
        f"retrieval.collection={BUFFER_COLLECTION}",
        "serve.min_replicas=1",
        "trainer.total_steps=1",
        "trainer.eval_size=4",
        "rollout.max_response_tokens=96",
        "rollout.max_step_tokens=32",
        "checkpoint.every=0",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.name=submitted",
    ]
    client = JobSubmissionClient(address)
    job, deadline = None, time.monotonic() + 120
    while job is None:  # right after `ray start` the head's job agent may not be up yet ("No available agent")
        try:
            job = client.submit_job(
                entrypoint="python jobs/train.py " + " ".join(overrides),
                runtime_env={"working_dir": str(REPO), "env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
            )
        except RuntimeError as exc:
            if "No available agent" not in str(exc):
                raise
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the head's job agent was not up 120 s after `ray start`:\n{agent_logs(temp)}"
                ) from exc
            time.sleep(2)
    deadline = time.monotonic() + 900
    status = client.get_job_status(job)
    while status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) and time.monotonic() < deadline:
        time.sleep(2)
        status = client.get_job_status(job)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, f"job {job} ended {status}:\n{logs[-4000:]}"
    # 2 learners + 2 workers at 1 CPU each do not fit 2 CPUs: the job shrank its shares by one factor and said so
    assert "= 4 CPUs, but the cluster has 2" in logs
    assert "resources.cpus_per_learner=0.5 resources.cpus_per_rollout_worker=0.5" in logs
    assert (tmp_path / "runs" / "submitted" / "summary.json").is_file()
