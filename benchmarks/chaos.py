"""Chaos benchmark (issue #22): run a short training job, kill its parts at random phases, check what survived.

    python benchmarks/chaos.py                        # 36 faults: every kind x every phase once, 4 per run
    python benchmarks/chaos.py --faults 12 --seed 1   # a random share of them
    python benchmarks/chaos.py --quick                # the test suite's version: 4 faults in one run

An uninterrupted run of the same config comes first (the reference); then runs with faults. A fault is a kind
(what dies) and a phase (when): it is injected a random fraction into the phase of a planned step, from a thread
of the driver, while the phase runs.

    kinds:  rollout_worker, learner, retrieval_replica, serve_controller, milvus (the milvus-lite server),
            driver (SIGKILL, then the job is started again with checkpoint.resume)
    phases: rollout, old_logprob, update, sync, evaluation, checkpoint

Each run with faults is checked: the job finished; every step's trajectories hold each group of the reference's
step exactly once with every slot; the final weights equal the reference's bit for bit unless a slot really
degraded to an on-policy step (a failed retrieval: listed with its step) or was rolled out by other weights than
the reference's (with algo.max_staleness >= 1, a worker replacing a dead one during an update starts from the updated
weights: listed with its step); no process the run started outlives
it. The table gives, per fault, where it landed, whether the run survived it, and the time it cost (that step's
iteration, first start to checkpoint written, against the reference's). Results: --out (JSON).

The job is the suite's tiny warm-started RAPO config (torch engine, 2 rollout workers, 2 FSDP learners, one
retrieval replica, a checkpoint and an evaluation every step), which is deterministic run to run: its warm start
and buffer are built once in --artifacts. Extra `section.key=value` arguments override it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rapo_ray.core.net import short_temp_dir
from rapo_ray.training.reporting import read_metrics

REPO = Path(__file__).resolve().parents[1]
KINDS = ("rollout_worker", "learner", "retrieval_replica", "serve_controller", "milvus", "driver")
PHASES = ("rollout", "old_logprob", "update", "sync", "evaluation", "checkpoint")

# On top of rapo_ray.config's TINY_OVERRIDES + TINY_WARM_OVERRIDES: evaluation and a checkpoint every step, one replica.
CHAOS_CONFIG = (
    "trainer.eval_every=1",
    "checkpoint.every=1",
    "checkpoint.keep_last=2",
    "retrieval.timeout_s=10",
    "serve.min_replicas=1",
    "serve.max_replicas=1",
)


# ---------------------------------------------------------------- inside the job's driver


class Injector:
    """Wraps the phases of the driver's Trainer and fires the planned faults from a timer thread."""

    def __init__(self, plan: list[dict], events_path: Path):
        self.plan = [dict(f, fired=False) for f in plan]
        self.events = open(events_path, "a")
        self.step = 0  # the step the trainer is in (1-based); evaluation and checkpoint of step k are in k
        self.trainer = None
        self.retrieval = None
        self.running: dict[str, int] = {}  # phase -> calls in progress
        self.lock = threading.Lock()

    def event(self, **e) -> None:
        with self.lock:
            self.events.write(json.dumps({"t": time.time(), **e}) + "\n")
            self.events.flush()
            os.fsync(self.events.fileno())

    def install(self) -> None:
        from rapo_ray.launch import launcher
        from rapo_ray.training import trainer
        from rapo_ray.workers import learner, rollout

        inj = self

        def wrap(cls, name, phase_of):
            orig = getattr(cls, name)

            def wrapped(self_, *args, **kwargs):
                phase = phase_of(args, kwargs)
                if phase is None:
                    return orig(self_, *args, **kwargs)
                return inj.in_phase(phase, lambda: orig(self_, *args, **kwargs))

            setattr(cls, name, wrapped)

        wrap(rollout.RolloutFleet, "run_step", lambda a, k: "evaluation" if k.get("evaluation") else "rollout")
        wrap(learner.LearnerGroup, "forward_old", lambda a, k: "old_logprob")
        wrap(learner.LearnerGroup, "update", lambda a, k: "update")
        wrap(trainer.Trainer, "sync_weights", lambda a, k: "sync")
        wrap(trainer.Trainer, "save", lambda a, k: "checkpoint")

        t_init, t_step = trainer.Trainer.__init__, trainer.Trainer.step

        def init(self_, *a, **k):
            t_init(self_, *a, **k)
            inj.trainer = self_

        def step(self_, *a, **k):
            inj.step = self_.step_idx + 1
            return t_step(self_, *a, **k)

        trainer.Trainer.__init__, trainer.Trainer.step = init, step
        r_init = launcher.RetrievalService.__init__

        def retrieval_init(self_, *a, **k):
            r_init(self_, *a, **k)
            inj.retrieval = self_

        launcher.RetrievalService.__init__ = retrieval_init

    def in_phase(self, phase: str, call):
        step = self.step
        timers = []
        for f in self.plan:
            if not f["fired"] and f["step"] == step and f["phase"] == phase:
                f["fired"] = True
                timers.append(threading.Timer(f["delay_s"], self.fire, args=(f,)))
        with self.lock:
            self.running[phase] = self.running.get(phase, 0) + 1
        t0 = time.time()
        ok = False
        for t in timers:
            t.start()
        try:
            out = call()
            ok = True
            return out
        finally:
            with self.lock:
                self.running[phase] -= 1
            self.event(ev="phase", phase=phase, step=step, t0=t0, t1=time.time(), ok=ok)
            for t in timers:
                t.join()

    def fire(self, f: dict) -> None:
        with self.lock:
            landed = self.running.get(f["phase"], 0) > 0
        try:
            what = self.kill(f["kind"], f, landed)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            what = f"not injected: {type(exc).__name__}: {exc}"
        self.fault_event(f, landed, what)

    def fault_event(self, f: dict, landed: bool, what: str) -> None:
        self.event(
            ev="fault",
            id=f["id"],
            kind=f["kind"],
            phase=f["phase"],
            step=f["step"],
            delay_s=f["delay_s"],
            landed=landed,
            what=what,
        )

    def kill(self, kind: str, f: dict, landed: bool) -> str:
        import ray

        rng = random.Random(f["id"])
        if kind == "rollout_worker":
            wid = rng.choice(sorted(self.trainer.fleet.workers))
            ray.kill(self.trainer.fleet.workers[wid], no_restart=True)
            return f"rollout worker {wid}"
        if kind == "learner":
            rank = rng.randrange(len(self.trainer.learners.workers))
            ray.kill(self.trainer.learners.workers[rank], no_restart=True)
            return f"learner rank {rank}"
        if kind == "retrieval_replica":
            (replica,) = [
                a
                for a in ray.util.list_named_actors(all_namespaces=True)
                if "SERVE_REPLICA::retrieval#StepRetriever" in a["name"]
            ]
            ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
            return replica["name"]
        if kind == "serve_controller":
            ray.kill(ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve"), no_restart=False)
            return "SERVE_CONTROLLER_ACTOR (Serve restarts it)"
        if kind == "milvus":
            server = self.retrieval._server
            os.kill(server.proc.pid, signal.SIGKILL)
            return f"milvus-lite server pid {server.proc.pid}"
        if kind == "driver":  # recorded first: nothing runs after the SIGKILL
            self.fault_event(f, landed, f"driver pid {os.getpid()} SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"unknown fault kind {kind!r}")


def driver_main(args) -> int:
    """The job's driver with the injector installed: ``launcher.run`` on the given overrides."""
    from rapo_ray.config import load_config
    from rapo_ray.launch.launcher import run

    plan = json.loads(Path(args.plan).read_text())
    inj = Injector(plan, Path(args.events))
    inj.install()
    cfg = load_config(overrides=args.overrides)
    summary = run(cfg, log=lambda *a: print(*a, flush=True))
    inj.event(ev="done", summary=summary["checkpoint"])
    return 0


# ---------------------------------------------------------------- the benchmark


def _processes() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if cmd:
                out[int(entry)] = cmd
    return out


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _carries_a_mark(pid: int, cmd: str, marks: list[str]) -> bool:
    """Ray's processes and the milvus-lite server carry the job's RAY_TMPDIR in their environment or the job's
    folders on their command line."""
    if any(m in cmd for m in marks):
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return any(m in environ for m in marks)


def _job_processes(procs: dict[int, str], before: set[int], marks: list[str]) -> dict[int, str]:
    """The processes of ``procs`` that did not exist before the job and belong to it: those carrying its marks,
    everything below them (a python sandbox server, with its own clean environment, is a rollout worker's child),
    and a sandbox server whose parent is gone (re-parented to init). Anything else on the machine (another Ray, a
    test session's sandbox servers running beside the job) is not the job's."""
    new = {p: c for p, c in procs.items() if p not in before and p != os.getpid()}
    parents = {p: _parent(p) for p in new}
    mine = {p for p, c in new.items() if _carries_a_mark(p, c, marks)}
    grew = True
    while grew:  # the closure under "child of a process of the job"
        below = {p for p, parent in parents.items() if parent in mine and p not in mine}
        mine |= below
        grew = bool(below)
    orphans = {p for p, c in new.items() if "sandbox_runner" in c and (parents[p] == 1 or parents[p] not in procs)}
    return {p: new[p] for p in mine | orphans}


def _stop(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(name: str, overrides: list[str], plan: list[dict], work: Path, log) -> dict:
    """One job (a driver process; after a driver fault, the same job resumed), its events and leftovers."""
    events = work / f"{name}.events.jsonl"
    events.unlink(missing_ok=True)
    run_dir = work / "runs" / name
    before = set(_processes())
    # Ray's sockets live under RAY_TMPDIR, and a Unix socket path has at most 107 bytes: a short folder of its own
    ray_tmp = Path(short_temp_dir("rapo_chaos_ray_"))
    t0 = time.time()
    attempts, remaining = 0, list(plan)
    while True:
        attempts += 1
        extra = [f"checkpoint.resume={run_dir}"] if attempts > 1 else []
        (work / f"{name}.plan.json").write_text(json.dumps(remaining))
        env = dict(os.environ, RAY_TMPDIR=str(ray_tmp / str(attempts)), PYTHONUNBUFFERED="1")
        with open(work / f"{name}.log", "a") as out:
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "_driver",
                    "--plan",
                    str(work / f"{name}.plan.json"),
                    "--events",
                    str(events),
                    "--",
                    *overrides,
                    f"run.output_dir={work / 'runs'}",
                    f"run.name={name}",
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        fired = {e["id"] for e in _read(events) if e["ev"] == "fault"}
        remaining = [f for f in remaining if f["id"] not in fired]
        driver_killed = proc.returncode == -signal.SIGKILL and any(
            e["ev"] == "fault" and e["kind"] == "driver" for e in _read(events)
        )
        if proc.returncode == 0 or not driver_killed or attempts > 1 + sum(f["kind"] == "driver" for f in plan):
            break
        log(f"  {name}: driver killed; resuming")
    wall = time.time() - t0
    marks = [str(work), str(ray_tmp), *(o.split("=", 1)[1] for o in overrides if o.startswith("run.artifacts_dir="))]
    deadline = time.time() + 5.0  # the reaper's and the actors' own exit
    while True:
        left = _job_processes(_processes(), before, marks)
        if not left or time.time() > deadline:
            break
        time.sleep(0.25)
    _stop(left)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return {
        "name": name,
        "rc": proc.returncode,
        "wall_s": wall,
        "attempts": attempts,
        "run_dir": str(run_dir),
        "events": _read(events),
        "leftover_processes": sorted(left.values()),
    }


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a SIGKILL
            pass
    return out


def phase_medians(events: list[dict]) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for e in events:
        if e["ev"] == "phase" and e["ok"] and e["step"] > 0:
            by.setdefault(e["phase"], []).append(e["t1"] - e["t0"])
    return {p: sorted(v)[len(v) // 2] for p, v in by.items()}


def iteration_seconds(events: list[dict]) -> dict[int, float]:
    """Step k's iteration: the first start of its rollout (or of the phase a fault of step k hit, when the driver
    died before that rollout's end was recorded) to the last completed checkpoint write of step k."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for e in events:
        if e["ev"] == "phase" and e["step"] >= 1 and e["phase"] == "rollout":
            start[e["step"]] = min(start.get(e["step"], e["t0"]), e["t0"])
        if e["ev"] == "fault":
            began = e["t"] - e.get("delay_s", 0.0)
            start[e["step"]] = min(start.get(e["step"], began), began)
        if e["ev"] == "phase" and e["phase"] == "checkpoint" and e["ok"]:
            end[e["step"]] = e["t1"]
    return {k: end[k] - start[k] for k in start if k in end}


def time_lost(fault: dict, plan: list[dict], iters: dict, ref_iters: dict) -> float:
    """Seconds a fault cost: the iterations from its step up to the next fault's step, against the reference's.
    A fault's cost can land in later steps (a restarted Serve controller replaces the retrieval replica, and the
    next rollout's retrievals wait for the new one), so those steps count towards it."""
    later = [f["step"] for f in plan if f["step"] > fault["step"]]
    until = min(later, default=max(ref_iters) + 1)
    steps = range(fault["step"], until)
    if any(k not in iters or k not in ref_iters for k in steps):
        return float("nan")
    return round(sum(iters[k] - ref_iters[k] for k in steps), 2)


SCORE_TOLERANCE = 1e-5


def same_trajectories(mine, theirs) -> bool:
    """The same trajectories row for row (tool timings aside). A retrieval's similarity score is compared to
    ``SCORE_TOLERANCE``: it is reporting only (no loss term reads it), and a replica that was replaced embeds a
    query in another length-sorted sub-batch, which moves the score's last float bits, not the neighbour."""
    if mine.num_rows != theirs.num_rows or mine.schema.names != theirs.schema.names:
        return False
    for a, b in zip(mine.to_pylist(), theirs.to_pylist()):
        ra, rb = a.pop("retrievals") or [], b.pop("retrievals") or []
        if a != b or len(ra) != len(rb):
            return False
        for x, y in zip(ra, rb):
            if abs(x.pop("score") - y.pop("score")) > SCORE_TOLERANCE or x != y:
                return False
    return True


def other_weights(mine, theirs) -> int:
    """How many of ``mine``'s trajectories were sampled by another policy version than ``theirs``'s same slot."""
    ref = dict(
        zip(
            zip(theirs.column("group_id").to_pylist(), theirs.column("slot").to_pylist()),
            theirs.column("policy_version").to_pylist(),
        )
    )
    keys = zip(mine.column("group_id").to_pylist(), mine.column("slot").to_pylist())
    return sum(1 for k, v in zip(keys, mine.column("policy_version").to_pylist()) if k in ref and ref[k] != v)


def final_weights(run: dict):
    from safetensors.torch import load_file

    summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
    return load_file(str(Path(summary["checkpoint"]) / "model.safetensors"))


def check(run: dict, ref: dict, group_size: int) -> dict:
    """Groups exactly once, degraded slots, weights against the reference."""
    import pyarrow.parquet as pq
    import torch

    out: dict = {"finished": run["rc"] == 0 and (Path(run["run_dir"]) / "summary.json").is_file()}
    lost = dup = 0
    out["first_divergent_step"] = None  # the first step whose trajectories differ from the reference's
    # step -> trajectories sampled by another policy version than the reference's same slot: with algo.max_staleness
    # >= 1, a worker that replaces a dead one during an update starts from the updated weights
    out["other_weights"] = {}
    for f in sorted((Path(ref["run_dir"]) / "trajectories").glob("step-*.parquet")):
        theirs = pq.read_table(f).drop_columns(["tool_time_s"])
        want = set(theirs.column("group_id").to_pylist())
        path = Path(run["run_dir"]) / "trajectories" / f.name
        mine = pq.read_table(path).drop_columns(["tool_time_s"]) if path.is_file() else None
        got = mine.column("group_id").to_pylist() if mine is not None else []
        counts = {g: got.count(g) for g in set(got)}
        lost += sum(1 for g in want if counts.get(g, 0) < group_size)
        dup += sum(1 for g, c in counts.items() if c > group_size or g not in want)
        if out["first_divergent_step"] is None and (mine is None or not same_trajectories(mine, theirs)):
            out["first_divergent_step"] = int(f.stem.split("-")[1])
        if mine is not None and (n := other_weights(mine, theirs)):
            out["other_weights"][int(f.stem.split("-")[1])] = n
    out["lost_groups"], out["duplicated_groups"] = lost, dup
    metrics = {m["step"]: m for m in read_metrics(run["run_dir"], steps_only=True)}  # a replayed step's last record
    out["degraded"] = {k: m.get("retrieval_errors", 0) for k, m in sorted(metrics.items()) if m.get("retrieval_errors")}
    out["insert_errors"] = sum(m.get("insert_errors", 0) for m in metrics.values())
    # identical to the reference until a slot degraded or was rolled out by other weights (from then on it is
    # another, equally valid run)
    first_degraded = min([*out["degraded"], *out["other_weights"]], default=None)
    div = out["first_divergent_step"]
    out["replayed_exactly"] = div is None or (first_degraded is not None and div >= first_degraded)
    if out["finished"]:
        a, b = final_weights(run), final_weights(ref)
        out["weights_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    else:
        out["weights_equal"] = False
    return out


def make_plan(n_faults: int, per_run: int, steps: int, seed: int, medians: dict, quick: bool) -> list[list[dict]]:
    rng = random.Random(seed)
    if quick:
        combos = [
            ("rollout_worker", "old_logprob"),
            ("retrieval_replica", "rollout"),
            ("learner", "update"),
            ("driver", "sync"),
        ]
    else:
        combos = [(k, p) for k in KINDS for p in PHASES]
        rng.shuffle(combos)
        if n_faults <= len(combos):
            combos = combos[:n_faults]
        else:
            combos += [(rng.choice(KINDS), rng.choice(PHASES)) for _ in range(n_faults - len(combos))]
    runs, fid = [], 0
    for start in range(0, len(combos), per_run):
        chunk = combos[start : start + per_run]
        fault_steps = rng.sample(range(2, steps + 1), len(chunk))  # step 1 has no checkpoint to resume a driver from
        run = []
        for (kind, phase), step in zip(chunk, fault_steps):
            fid += 1
            frac = rng.uniform(0.05, 0.6)
            run.append(
                {
                    "id": fid,
                    "kind": kind,
                    "phase": phase,
                    "step": step,
                    "delay_s": round(frac * medians.get(phase, 0.1), 3),
                }
            )
        runs.append(run)
    return runs


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_driver":
        p = argparse.ArgumentParser()
        p.add_argument("--plan", required=True)
        p.add_argument("--events", required=True)
        p.add_argument("overrides", nargs="*")
        return driver_main(p.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=36, help="faults in all (36 = every kind x phase once)")
    ap.add_argument("--per-run", type=int, default=4, help="faults per job (at distinct steps)")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per job")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 faults (worker, replica, learner, driver) in one job")
    ap.add_argument("--artifacts", default="", help="warm start and buffer cache (default: a folder under --work)")
    ap.add_argument("--work", default="", help="runs, logs, events (default: a new temporary folder)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chaos.json"))
    ap.add_argument("overrides", nargs="*", help="section.key=value on top of the chaos config")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 6)
    work = Path(args.work or tempfile.mkdtemp(prefix="rapo_chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    art = Path(args.artifacts or work / "artifacts")
    from rapo_ray.config import TINY_OVERRIDES, TINY_WARM_OVERRIDES

    overrides = [
        f"run.artifacts_dir={art}",
        *TINY_OVERRIDES,
        *TINY_WARM_OVERRIDES,
        *CHAOS_CONFIG,
        f"trainer.total_steps={args.steps}",
        *args.overrides,
    ]
    group_size = int(next(o.split("=")[1] for o in reversed(overrides) if o.startswith("algo.group_size=")))
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    log(f"chaos: work folder {work}")
    ref = run_job("reference", overrides, [], work, log)
    if ref["rc"] != 0:
        log(f"the reference run failed (rc {ref['rc']}); see {work / 'reference.log'}")
        return 1
    medians = phase_medians(ref["events"])
    ref_iter = iteration_seconds(ref["events"])
    log(f"reference: {ref['wall_s']:.0f} s; phase medians " + ", ".join(f"{p} {s:.2f}s" for p, s in medians.items()))
    plans = make_plan(args.faults, args.per_run, args.steps, args.seed, medians, args.quick)
    rows, runs = [], []
    for i, plan in enumerate(plans):
        name = f"faults-{i:02d}"
        log(f"{name}: " + ", ".join(f"{f['kind']}@{f['phase']} step {f['step']}" for f in plan))
        run = run_job(name, overrides, plan, work, log)
        result = check(run, ref, group_size)
        iters = iteration_seconds(run["events"])
        fired = {e["id"]: e for e in run["events"] if e["ev"] == "fault"}
        for f in plan:
            e = fired.get(f["id"])
            rows.append(
                {
                    **{k: f[k] for k in ("id", "kind", "phase", "step")},
                    "run": name,
                    "injected": bool(e) and not e["what"].startswith("not injected"),
                    "landed_in_phase": bool(e and e["landed"]),
                    "what": e["what"] if e else "phase not reached",
                    "survived": result["finished"],
                    "time_lost_s": time_lost(f, plan, iters, ref_iter),
                }
            )
        runs.append({**{k: run[k] for k in ("name", "rc", "wall_s", "attempts", "leftover_processes")}, **result})
        log(
            f"  {name}: rc {run['rc']}, {run['wall_s']:.0f} s, groups lost {result['lost_groups']} duplicated "
            f"{result['duplicated_groups']}, weights equal {result['weights_equal']}, degraded {result['degraded']}, "
            f"rolled out by other weights {result['other_weights']}, "
            f"first step unlike the reference {result['first_divergent_step']}, "
            f"leftover processes {len(run['leftover_processes'])}"
        )
    report = {
        "reference": {
            "wall_s": ref["wall_s"],
            "phase_medians_s": medians,
            "iteration_s": ref_iter,
            "leftover_processes": ref["leftover_processes"],
        },
        "config": overrides,
        "faults": rows,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    log(table(report))
    ok = (
        all(
            r["finished"]
            and not r["lost_groups"]
            and not r["duplicated_groups"]
            and not r["leftover_processes"]
            and r["replayed_exactly"]
            and (r["weights_equal"] or r["degraded"] or r["other_weights"])
            for r in runs
        )
        and not ref["leftover_processes"]
    )
    log(f"wrote {args.out}; {'every run passed its checks' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


def table(report: dict) -> str:
    lines = [
        "| kind | phase | faults | landed in phase | survived | time lost (s, median) |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list] = {}
    for r in report["faults"]:
        groups.setdefault((r["kind"], r["phase"]), []).append(r)
    for (kind, phase), rs in sorted(groups.items()):
        lost = sorted(r["time_lost_s"] for r in rs)  # one fault per kind x phase in the default plan
        lines.append(
            f"| {kind} | {phase} | {len(rs)} | {sum(r['landed_in_phase'] for r in rs)} | "
            f"{sum(r['survived'] for r in rs)} | {lost[len(lost) // 2]:.1f} |"
        )
    lines += [
        "",
        "| run | rc | wall s | lost groups | duplicated groups | degraded slots (step: n) | slots of other weights "
        "(step: n) | first step unlike the reference | final weights equal | leftover processes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['name']} | {r['rc']} | {r['wall_s']:.0f} | {r['lost_groups']} | {r['duplicated_groups']} | "
            f"{r['degraded'] or '-'} | {r.get('other_weights') or '-'} | {r['first_divergent_step'] or '-'} | "
            f"{r['weights_equal']} | "
            f"{len(r['leftover_processes'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
