"""The Ray actors on a local Ray: fleet accounting and scaling, dead workers, the weight sync, learner updates and
checkpoints."""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import pytest
import ray
import torch

from rapo_ray.model.factory import pad_token_id
from rapo_ray.types.learner_batch import LearnerBatch, from_numpy
from rapo_ray.types.trajectory import Task, Trajectory


class _RankCalls:
    """``rank.update(x)`` for ``ray.get(host.call.remote("update", x))``."""

    def __init__(self, host):
        self._host = host

    def __getattr__(self, method):
        return lambda *args: ray.get(self._host.call.remote(method, *args))


@pytest.fixture(scope="module")
def rank_host(ray_session):
    """One Ray worker process that builds single-rank ``LearnerWorker``s, one at a time, for the tests of a rank's
    maths: each rank is built fresh (model loaded, new optimizer, new gloo group), but the process start (imports,
    transformers' ~4 s) is paid once per module instead of once per rank. Calls cross Ray as a rank actor's do.
    (Defined here so that Ray ships the class by value: workers cannot import this test module.)"""

    class LearnerRankHost:
        def __init__(self):
            self.rank = None

        def start(self, model_dir: str, cfg_dict: dict) -> bool:
            from rapo_ray.core.net import free_port
            from rapo_ray.workers.learner import LearnerWorker

            self.stop()
            self.rank = LearnerWorker(0, 1, free_port(), model_dir, cfg_dict, "gloo")
            return True

        def call(self, method: str, *args):
            return getattr(self.rank, method)(*args)

        def stop(self) -> bool:
            if self.rank is not None:
                self.rank.shutdown()
                self.rank = None
            return True

    host = ray.remote(num_cpus=0.5)(LearnerRankHost).remote()
    yield host
    ray.get(host.stop.remote())
    ray.kill(host)


@contextmanager
def learner_rank(host, model_dir, cfg):
    """A fresh single-rank learner on ``cfg`` in the module's host process; shut down (its gloo group destroyed) on
    exit."""
    from dataclasses import asdict

    ray.get(host.start.remote(str(model_dir), asdict(cfg)))
    try:
        yield _RankCalls(host)
    finally:
        ray.get(host.stop.remote())


def _groups(n):
    return [(f"g{i}", Task(f"t{i}", f"Who is the mentor of Ka{i}?", ("x",))) for i in range(n)]


def _move_weights(learners, step: float) -> None:
    """Shift every learner parameter (each rank its own FSDP shard) by ``step``: a stand-in for an update."""

    def shift(worker, step):
        with torch.no_grad():
            for p in worker.model.parameters():
                p.add_(step)
        return True

    ray.get([w.__ray_call__.remote(shift, step) for w in learners.workers])


def _optimizer_step(learners) -> None:
    """One AdamW step on every rank with a made-up gradient: what an update does to the parameters (the weight
    sync keeps views of them between pushes, which must follow)."""

    def step(worker):
        for p in worker.model.parameters():
            p.grad = torch.full_like(p, 0.5)
        worker.opt.step()
        worker.opt.zero_grad()
        return True

    ray.get([w.__ray_call__.remote(step) for w in learners.workers])


def _assert_workers_hold(fleet, learners, version, dtype=torch.float32):
    """Every worker's engine holds the learners' weights bit for bit, as cast to the wire ``dtype``."""
    want = learners.state_dict()
    for w in fleet.handles():
        got = ray.get(w.state_dict.remote())
        assert ray.get(w.ready.remote())["version"] == version
        for k, v in want.items():
            assert torch.equal(got[k], v.to(dtype).to(got[k].dtype)), k


@pytest.fixture(scope="class")
def sync_topology(ray_session, fleet_cfg, tiny_model_dir):
    """Two FSDP learner ranks, a two-worker fleet whose new workers are brought up to date, and the sync: started
    once (~20 s) for the tests of ``TestWeightSync``, each of which leaves it whole for the next."""
    from dataclasses import replace

    from rapo_ray.workers.learner import LearnerGroup
    from rapo_ray.workers.rollout import RolloutFleet
    from rapo_ray.workers.sync import WeightSync

    cfg = replace(fleet_cfg, resources=replace(fleet_cfg.resources, cpus_per_learner=0.5))
    learners = LearnerGroup(cfg, tiny_model_dir)
    sync = WeightSync(bucket_mb=0.05, timeout_s=120)  # several buckets
    state = {"version": 0}

    def bring_up_to_date(workers):
        if state["version"]:
            sync.push(learners.workers, workers, state["version"])

    fleet = RolloutFleet(tiny_model_dir, cfg, retrieval_app=None, on_new_workers=bring_up_to_date)
    try:
        yield learners, fleet, sync, state
    finally:
        fleet.shutdown()
        learners.shutdown()
        sync.close()


@pytest.fixture
def sync_parts(sync_topology):
    """The shared topology at two workers, with a new weight-sync group due (as after a membership change)."""
    learners, fleet, sync, state = sync_topology
    fleet.scale(2)
    sync.reset()
    return learners, fleet, sync, state


def _trajectories_of_lengths(response_lengths: list[int]) -> list[Trajectory]:
    """One on-policy trajectory per length: a 2-token prompt and that many generated tokens, all trained."""
    return [
        Trajectory(f"g{i}", i, "on_policy", f"p{i}", "qa", (), prompt_ids=[3, 4], response_ids=[7] * n,
                   loss_mask=[1] * n)
        for i, n in enumerate(response_lengths)
    ]  # fmt: skip


def _four_rows(model_dir) -> tuple[LearnerBatch, float]:
    """Four trained rows of 6-9 generated tokens after a 3-token prompt, and their loss tokens (the denominator)."""
    trajs = [
        Trajectory(f"g{i}", i, "on_policy", f"p{i}", "qa", (), prompt_ids=[3, 4, 5],
                   response_ids=list(range(6, 12 + i)), loss_mask=[1] * (6 + i))
        for i in range(4)
    ]  # fmt: skip
    return LearnerBatch.from_trajectories(trajs, pad_token_id(model_dir)), float(sum(len(t.loss_mask) for t in trajs))


def _kill(worker):
    ray.kill(worker, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):  # until the kill has landed
            ray.get(worker.ready.remote())


def test_killed_worker_loses_no_group(ray_session, fleet_cfg, tiny_model_dir):
    from rapo_ray.workers.rollout import RolloutFleet

    fleet = RolloutFleet(tiny_model_dir, fleet_cfg, retrieval_app=None)
    try:
        killed = []

        def kill_first(wid, take):  # kill the first worker right after it received its chunk
            if not killed:
                killed.append(wid)
                ray.kill(fleet.workers[wid])

        groups = _groups(6)
        batch, stats = fleet.run_step(groups, group_size=2, seed=1, on_dispatch=kill_first)
        assert killed and stats["requeued_groups"] >= 1 and stats["replaced_workers"] == 1
        ids = [(t.group_id, t.slot) for t in batch]
        assert sorted(ids) == sorted((g, s) for g, _ in groups for s in range(2))  # every group once, each slot once
        assert len(fleet.workers) == 2
    finally:
        fleet.shutdown()


class _KillingSpawner:
    """The fleet's actor spawner, except that the first ``deaths`` workers it starts die before they answer (as
    when Ray's memory monitor kills a starting worker)."""

    def __init__(self, cfg, model_dir, deaths: int):
        from rapo_ray.workers.rollout import ActorSpawner

        self.inner, self.deaths = ActorSpawner(cfg, str(model_dir), None), deaths

    def spawn(self, ids):
        handles = self.inner.spawn(ids)
        for handle in handles[: self.deaths]:
            ray.kill(handle)
        self.deaths -= min(self.deaths, len(handles))
        return handles

    def kill(self, handle):
        self.inner.kill(handle)

    def release(self, handle):
        self.inner.release(handle)


def test_a_worker_dying_while_it_starts_is_started_again_and_endless_deaths_are_an_error(
    ray_session, fleet_cfg, tiny_model_dir
):
    from rapo_ray.workers.rollout import START_ATTEMPTS, RolloutFleet

    fleet = RolloutFleet(tiny_model_dir, fleet_cfg, None, spawner=_KillingSpawner(fleet_cfg, tiny_model_dir, 1))
    try:
        assert len(fleet.workers) == fleet_cfg.rollout.num_workers == 2
        assert [e.detail.split(" (")[0] for e in fleet.events if e.kind == "replaced"] == [
            "worker 0 died while starting"
        ]
        groups = _groups(2)
        batch, _ = fleet.run_step(groups, group_size=2, seed=1)
        assert sorted((t.group_id, t.slot) for t in batch) == sorted((g, s) for g, _ in groups for s in range(2))
    finally:
        fleet.shutdown()
    with pytest.raises(RuntimeError, match=f"died while starting, {START_ATTEMPTS} times in a row"):
        RolloutFleet(tiny_model_dir, fleet_cfg, None, spawner=_KillingSpawner(fleet_cfg, tiny_model_dir, 10**6))


def test_relays_give_the_direct_calls_batch_and_lose_no_group_when_a_worker_or_relay_dies(
    ray_session, fleet_cfg, tiny_model_dir
):
    """Through per-node relays (``rollout.relay_min_workers``) a step is the same as with one call per worker, bit
    for bit; a worker killed in the round, and then the relay itself, cost no group and count none twice."""
    from dataclasses import replace

    from rapo_ray.workers.rollout import RolloutFleet

    direct = replace(fleet_cfg, rollout=replace(fleet_cfg.rollout, relay_min_workers=0))
    relayed = replace(fleet_cfg, rollout=replace(fleet_cfg.rollout, relay_min_workers=2))
    fleet = RolloutFleet(tiny_model_dir, direct, retrieval_app=None)
    groups = _groups(4)
    every = sorted((g, s) for g, _ in groups for s in range(2))

    def rows(batch):
        return [(t.group_id, t.slot, t.response_ids.tolist(), t.logprobs.tolist()) for t in batch]

    try:
        want, _ = fleet.run_step(groups, group_size=2, seed=3)
        assert not fleet.uses_relays() and not fleet.relays
        fleet.cfg = relayed
        got, stats = fleet.run_step(groups, group_size=2, seed=3)
        assert fleet.uses_relays() and len(fleet.relays) == 1  # one node: one relay, holding both workers
        assert rows(got) == rows(want)
        assert stats["requeued_groups"] == stats["replaced_workers"] == stats["lost_relays"] == 0

        killed = []

        def kill_first_worker(wid, take):
            if not killed:
                killed.append(wid)
                ray.kill(fleet.workers[wid])

        batch, stats = fleet.run_step(groups, group_size=2, seed=4, on_dispatch=kill_first_worker)
        assert stats["requeued_groups"] == 2 and stats["replaced_workers"] == 1 and stats["lost_relays"] == 0
        assert sorted((t.group_id, t.slot) for t in batch) == every and len(fleet.workers) == 2

        def kill_relay(wid, take):
            for relay in list(fleet.relays.values()):
                ray.kill(relay)

        batch, stats = fleet.run_step(groups, group_size=2, seed=5, on_dispatch=kill_relay)
        assert stats["lost_relays"] == 1 and stats["requeued_groups"] == 4 and stats["replaced_workers"] == 0
        assert sorted((t.group_id, t.slot) for t in batch) == every
        assert any("relay of node" in e.detail for e in fleet.events)
        batch, stats = fleet.run_step(groups, group_size=2, seed=6)  # the next step starts a new relay
        assert len(fleet.relays) == 1 and stats["lost_relays"] == 0 and len(batch) == 8
    finally:
        fleet.shutdown()


class TestWeightSync:
    """The learners, the fleet and the sync of ``sync_topology``, shared by the tests in turn."""

    def test_scale_up_down_and_weight_sync(self, sync_parts):
        """Issue #19: the learners send to the engines directly; a worker added mid-run holds the current version
        before its first rollout; the group is rebuilt for every membership; bf16 on the wire is bf16 in the engine."""
        from rapo_ray.workers.sync import WeightSync

        learners, fleet, sync, state = sync_parts
        first_event = len(fleet.events)
        _move_weights(learners, 0.01)
        assert sync.push(learners.workers, fleet.handles(), 3) > 0
        state["version"] = 3
        _assert_workers_hold(fleet, learners, 3)
        assert sync.last["bytes"] > 0 and sync.last["buckets"] > 1
        before = learners.state_dict()
        _optimizer_step(learners)
        sync.push(learners.workers, fleet.handles(), 3)  # (same version number: only the weights are checked here)
        _assert_workers_hold(fleet, learners, 3)
        assert any(not torch.equal(before[k], v) for k, v in learners.state_dict().items())
        fleet.scale(3)  # the new worker is brought up to date before it takes work
        assert len(fleet.workers) == 3
        _assert_workers_hold(fleet, learners, 3)
        _move_weights(learners, -0.02)
        sync.push(learners.workers, fleet.handles(), 4)  # the group is rebuilt for 3 members
        state["version"] = 4
        _assert_workers_hold(fleet, learners, 4)
        half = WeightSync(bucket_mb=0.05, timeout_s=120, dtype="bfloat16")
        half.push(learners.workers, fleet.handles(), 5)
        _assert_workers_hold(fleet, learners, 5, dtype=torch.bfloat16)
        assert half.last["bytes"] < sync.last["bytes"] * 0.55  # half the bytes of fp32 (plus alignment)
        fleet.scale(1)
        assert len(fleet.workers) == 1
        batch, _ = fleet.run_step(_groups(2), 2, seed=0)
        assert len(batch) == 4 and {t.policy_version for t in batch} == {5}
        assert fleet.autoscale(backlog_groups=5, groups_per_worker=2) == 3  # ceil(5/2) capped by max_workers
        assert fleet.autoscale(backlog_groups=0) == 1
        assert fleet.events[0].kind == "start"
        assert [e.kind for e in fleet.events[first_event:]][:2] == ["scale_up", "scale_down"]

    def test_a_worker_that_dies_outside_a_rollout_is_replaced_at_the_weight_push(self, sync_parts):
        """Issue #22: a rollout worker killed after its rollout (during the old-logprob pass or the update) used to end
        the run at the next weight push. Now it is replaced with the current weights, whether the push meets it dead in
        the group of the last push or finds it dead before forming a new group. A push to an unchanged group pings no
        one, and a replacement gets one push, not a bring-up push and then the fleet's."""
        from rapo_ray.training.trainer import push_weights

        learners, fleet, sync, state = sync_parts
        first_event = len(fleet.events)
        pings = []
        check = fleet.replace_dead
        fleet.replace_dead = lambda *args, **kw: (pings.append(args), check(*args, **kw))[1]

        def push(version: int) -> tuple[int, int]:
            """(workers replaced, groups formed) by one push_weights."""
            _move_weights(learners, 0.01)
            state["version"] = version  # what the trainer's version is once the learners updated
            generation = sync.generation
            replaced = push_weights(sync, fleet, learners.workers, version)
            _assert_workers_hold(fleet, learners, version)
            return replaced, sync.generation - generation

        try:
            assert push(1) == (0, 1) and len(pings) == 1  # the first push forms the group: the fleet is checked first
            assert push(2) == (0, 0) and len(pings) == 1  # same group: no ping
            _kill(fleet.handles()[0])  # died idle, after its rollout: the push meets it, then replaces and retries
            assert push(3) == (1, 1) and len(fleet.workers) == 2 and len(pings) == 2
            sync.reset()  # a new group is due (as after a failed push): a dead worker is found before the group forms
            _kill(fleet.handles()[1])
            assert push(4) == (1, 1) and len(fleet.workers) == 2 and len(pings) == 3
        finally:
            del fleet.replace_dead  # the class's method again, for the next test
        batch, _ = fleet.run_step(_groups(2), 2, seed=0)
        assert len(batch) == 4
        assert sum(e.kind == "replaced" for e in fleet.events[first_event:]) == 2

    def test_a_worker_killed_during_the_broadcast_neither_hangs_the_push_nor_loads_a_mixed_version(self, sync_parts):
        """Issue #19: a member dying mid-push aborts the group: the survivors load nothing of the failed push (they keep
        the previous version whole), no learner rank is left waiting, and the retry brings everyone to
        the new version."""
        import threading
        import time

        from rapo_ray.core.errors import WORKER_DIED
        from rapo_ray.training.trainer import push_weights

        learners, fleet, sync, state = sync_parts
        _move_weights(learners, 0.01)
        sync.push(learners.workers, fleet.handles(), 1)
        state["version"] = 1
        before = learners.state_dict()
        _move_weights(learners, 0.01)

        def slow_sender(worker):  # 0.2 s per bucket on learner rank 0, so the kill lands mid-push
            import time

            import rapo_ray.workers.sync as sync_module

            worker.fast_pack_segment = fast = sync_module.pack_segment
            sync_module.pack_segment = lambda *args: (time.sleep(0.2), fast(*args))[1]
            return True

        def fast_sender(worker):
            import rapo_ray.workers.sync as sync_module

            sync_module.pack_segment = worker.fast_pack_segment
            return True

        ray.get(learners.workers[0].__ray_call__.remote(slow_sender))
        victim, survivor = fleet.handles()
        timer = threading.Timer(0.5, lambda: ray.kill(victim, no_restart=True))
        timer.start()
        t0 = time.perf_counter()
        try:
            with pytest.raises(WORKER_DIED):
                sync.push(learners.workers, fleet.handles(), 2)
        finally:
            timer.join()
            ray.get(learners.workers[0].__ray_call__.remote(fast_sender))
        assert time.perf_counter() - t0 < 30  # failed at once, not at the 120 s timeout
        assert sync.last["buckets"] > 3  # (of push 1) the kill landed before the last bucket
        got = ray.get(survivor.state_dict.remote())
        assert ray.get(survivor.ready.remote())["version"] == 1
        assert all(torch.equal(got[k], v) for k, v in before.items())  # version 1 whole: nothing of version 2
        state["version"] = 2
        assert push_weights(sync, fleet, learners.workers, 2) == 1
        _assert_workers_hold(fleet, learners, 2)


def test_colocated_workers_sit_in_the_learners_bundles_and_get_the_weights_through_shared_memory(
    ray_session, fleet_cfg, tiny_model_dir
):
    """Issue #65 (resources.colocate): worker r in learner rank r's bundle; a push is each rank's rows through
    /dev/shm, bit for bit in the engine; a worker that dies is replaced in the bundle it left and brought up to date
    by the next push; nothing is left in /dev/shm afterwards."""
    import glob
    from dataclasses import replace

    from ray.util.placement_group import placement_group_table

    from rapo_ray.training.trainer import push_weights
    from rapo_ray.workers.colocated import shared_dir
    from rapo_ray.workers.learner import LearnerGroup
    from rapo_ray.workers.rollout import ColocatedSpawner, RolloutFleet
    from rapo_ray.workers.sync import ColocatedSync

    rc = replace(fleet_cfg.resources, cpus_per_learner=0.5, colocate=True)
    cfg = replace(fleet_cfg, resources=rc, rollout=replace(fleet_cfg.rollout, max_workers=2)).validate()
    learners = LearnerGroup(cfg, tiny_model_dir)
    sync = ColocatedSync(timeout_s=120)
    spawner = ColocatedSpawner(cfg, str(tiny_model_dir), None, learners.pg, cfg.rollout.num_workers)
    fleet = RolloutFleet(tiny_model_dir, cfg, retrieval_app=None, spawner=spawner)
    try:
        table = placement_group_table(learners.pg)
        assert table["strategy"] == "STRICT_PACK" and table["bundles"][0] == {"CPU": 1.0}  # the pair's CPUs
        assert sorted(spawner.bundle_of.values()) == [0, 1]
        _move_weights(learners, 0.01)
        sync.push(learners.workers, fleet.handles(), 1)
        _assert_workers_hold(fleet, learners, 1)
        assert sync.last["bytes"] > 0 and sync.last["import_s"] > 0
        assert len(glob.glob(f"{shared_dir()}/{sync.prefix}-*")) == 2  # one segment per learner rank
        _kill(fleet.handles()[1])
        _move_weights(learners, -0.02)
        assert push_weights(sync, fleet, learners.workers, 2) == 1  # replaced in the freed bundle, then pushed
        assert sorted(spawner.bundle_of.values()) == [0, 1] and len(fleet.workers) == 2
        _assert_workers_hold(fleet, learners, 2)
        with pytest.raises(RuntimeError, match="0 of the learners' 2 worker bundles free"):
            spawner.spawn([99])
    finally:
        fleet.shutdown()
        learners.shutdown()
        sync.close()
    assert not glob.glob(f"{shared_dir()}/{sync.prefix}-*")


def test_a_push_whose_worker_ray_killed_for_memory_is_a_dead_worker_not_a_learner_error(ray_session):
    """A rollout worker that Ray's memory monitor killed fails its calls with OutOfMemoryError (no RayActorError),
    while the learners' sends fail on the closed socket first. The push must name the dead worker (the trainer then
    replaces it and pushes again), and name a learner killed that way a lost learner."""
    from rapo_ray.core.errors import WORKER_DIED, LearnerLost
    from rapo_ray.workers.sync import gather_push

    @ray.remote
    def send():
        raise RuntimeError("gloo: Connection closed by peer")

    @ray.remote
    def receive():
        raise ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")

    with pytest.raises(WORKER_DIED, match="running low on memory"):
        gather_push([send.remote(), send.remote(), receive.remote()], "sending", 30.0, n_learners=2)
    with pytest.raises(LearnerLost, match="running low on memory"):
        gather_push([receive.remote(), send.remote(), send.remote()], "sending", 30.0, n_learners=2)


def test_kl_penalty_pulls_the_policy_back_to_the_starting_model(rank_host, fleet_cfg, tiny_model_dir):
    """algo.kl_coef > 0: the learner keeps a frozen copy of the starting model; KL is 0 before any update,
    > 0 after a policy-gradient step, and zero-advantage updates (KL term only) shrink it again."""
    from dataclasses import replace

    from rapo_ray.core.metrics import merge_actor_stats

    cfg = replace(
        fleet_cfg, algo=replace(fleet_cfg.algo, kl_coef=1.0), learner=replace(fleet_cfg.learner, lr=3e-3, world_size=1)
    )
    with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
        # 4 rows: 3 prompt tokens, 6..9 response tokens, trained on all but a 2-token tool result
        trajs = [
            Trajectory(
                f"g{i}",
                i,
                "on_policy",
                f"p{i}",
                "qa",
                (),
                prompt_ids=[3, 4, 5],
                response_ids=list(range(6, 12 + i)),
                loss_mask=[1, 1, 0, 0, 1, 1] + [1] * i,
            )
            for i in range(4)
        ]
        batch = LearnerBatch.from_trajectories(trajs, pad_token_id(tiny_model_dir))
        ((old, ent),) = rank.forward_old([batch])["passes"]
        generated = batch.loss_mask.numpy() > 0  # the old-policy pass reads generated targets only
        assert (old[generated] < 0).all() and (ent[generated] > 0).all()
        assert not old[~generated].any() and not ent[~generated].any()
        batch.old_logprobs = from_numpy(old)
        batch = batch.with_signal({"advantage": [1.0 if i % 2 else -1.0 for i in range(4)], "shaping": [1.0] * 4})
        denominator = float(sum(t.loss_mask.sum() for t in trajs))
        push = merge_actor_stats([rank.update([([batch], denominator)])])
        assert push["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the first forward is the reference itself
        ((moved, _),) = rank.forward_old([batch])["passes"]
        batch = batch.with_signal({"advantage": [0.0] * 4, "shaping": [1.0] * 4})
        batch.old_logprobs = from_numpy(moved)
        kls = [merge_actor_stats([rank.update([([batch], denominator)])])["kl_ref"] for _ in range(4)]
        assert kls[0] > 1e-4 and kls[-1] < 0.5 * kls[0]


def test_micro_batches_accumulate_to_the_same_update(rank_host, fleet_cfg, tiny_model_dir):
    """learner.micro_batch_size: a mini-batch's rows in 1-row micro-batches (gradients accumulated) give the
    update that one 4-row micro-batch gives, to float tolerance; and the config splits a share as asked."""
    from dataclasses import replace

    from rapo_ray.core.metrics import merge_actor_stats

    assert replace(fleet_cfg.learner, micro_batch_size=0).micro_rows(8) == 8
    assert replace(fleet_cfg.learner, micro_batch_size=3).micro_rows(8) == 3
    assert replace(fleet_cfg.learner, micro_batch_size=3).micro_rows(2) == 2
    cfg = replace(fleet_cfg, learner=replace(fleet_cfg.learner, lr=3e-3, world_size=1))
    batch, denominator = _four_rows(tiny_model_dir)
    results = []
    for micro in (False, True):
        with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
            old = from_numpy(rank.forward_old([batch])["passes"][0][0])
            full = batch.with_signal({"advantage": [1.0 if r % 2 else -1.0 for r in range(4)], "shaping": [1.0] * 4})
            full.old_logprobs = old
            split = [full.select([i]) for i in range(4)] if micro else [full]
            stats = merge_actor_stats([rank.update([(split, denominator)])])
            after = from_numpy(rank.forward_old([batch])["passes"][0][0])
            results.append((stats, after, old))
    (whole, after_whole, old), (micro, after_micro, _) = results
    assert micro["loss_sum"] == pytest.approx(whole["loss_sum"], abs=1e-6)
    assert micro["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    moved = float((after_whole - old).abs().max())
    gap = float((after_whole - after_micro).abs().max())
    assert moved > 1e-3 and gap < 1e-4 * moved


@pytest.mark.parametrize("correction", ["none", "truncate"])
def test_the_update_standing_in_for_the_old_pass_gives_the_same_loss_gradients_and_values(
    rank_host, fleet_cfg, tiny_model_dir, correction
):
    """One optimizer step over the step's rows (rapo_ray/algos/old_pass.py): the update whose own log-probs,
    detached, are pi_old gives the loss, the gradient norm and the new weights that the separate old-policy pass
    gives, and hands back that pass's log-probs and entropies; in 2-row micro-batches, as the trainer splits a rank's
    rows. ``truncate``: rows rolled out ahead by older weights (algo.max_staleness=1), whose engine log-probs differ
    from pi_old by up to 1 nat, so that some behaviour weights pi_old / pi_behaviour are cut at the cap of 2."""
    from dataclasses import replace

    from rapo_ray.core.metrics import merge_actor_stats
    from rapo_ray.workers.learner import LearnerWorker

    algo = replace(fleet_cfg.algo, behaviour_correction=correction, behaviour_cap=2.0)
    cfg = replace(fleet_cfg, algo=algo, learner=replace(fleet_cfg.learner, lr=3e-3, world_size=1))
    batch, denominator = _four_rows(tiny_model_dir)
    full = batch.with_signal({"advantage": [1.0, -1.0, 0.5, -0.5], "shaping": [1.0] * 4})
    results = []
    for skip in (False, True):
        with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
            ((old, ent),) = rank.forward_old([batch])["passes"]  # before the update: pi_old
            mini = replace(full, old_logprobs=None if skip else from_numpy(old))
            if correction != "none":  # the engine's log-probs: pi_old shifted by -1 .. +0.2 nats
                gap = torch.tensor([0.5, 1.0, -0.2, 0.3, 0.4, 0.7])[torch.arange(old.shape[1]) % 6]
                mini.behaviour_logprobs = (from_numpy(old) - gap) * mini.loss_mask
            micro = [mini.select([0, 1]), mini.select([2, 3])]
            out = rank.update([(micro, denominator)], skip)
            stats, passes = out if skip else (out, None)
            after = from_numpy(rank.forward_old([batch])["passes"][0][0])
            results.append((merge_actor_stats([stats]), after, old, ent, passes))
    (with_pass, after_pass, old, ent, _), (skipped, after_skip, _, _, passes) = results
    assert skipped["loss_sum"] == pytest.approx(with_pass["loss_sum"], abs=1e-6)
    assert skipped["grad_norm"] == pytest.approx(with_pass["grad_norm"], rel=1e-5)
    if correction != "none":  # the same weights, some of them at the cap
        assert skipped["behaviour_weight_mean"] == pytest.approx(with_pass["behaviour_weight_mean"], rel=1e-5)
        assert skipped["behaviour_capped_frac"] == with_pass["behaviour_capped_frac"] > 0
        assert with_pass["behaviour_weight_mean"] > 1.3  # exp(gap): 1.65, 2 (cut), 0.82, 1.35, 1.49, 2 (cut)
    moved = float((after_pass - from_numpy(old)).abs().max())
    assert moved > 1e-3 and float((after_skip - after_pass).abs().max()) < 1e-4 * moved
    # the values handed back are the pass's, row by row (each micro-batch trimmed to its longest row)
    for rows, (lp, en) in zip(([0, 1], [2, 3]), passes):
        assert np.allclose(lp, old[rows, : lp.shape[1]], atol=1e-5) and np.allclose(
            en, ent[rows, : en.shape[1]], atol=1e-5
        )
    with pytest.raises(ValueError, match="one mini-batch"):  # a second optimizer step would not be at pi_old
        LearnerWorker.update(None, [([], 1.0), ([], 1.0)], True)


def test_the_behaviour_correction_reaches_the_learners_loss(rank_host, fleet_cfg, tiny_model_dir):
    """algo.behaviour_correction=truncate on a learner rank: engine log-probs equal to pi_old (weight 1) give the
    uncorrected update; an engine that gave every token 4x less probability than pi_old (weight 4, cut to 2) doubles
    the loss, and the update reports the weights it used."""
    from dataclasses import replace

    from rapo_ray.core.metrics import merge_actor_stats

    trajs = [
        Trajectory(f"g{i}", i, "on_policy", f"p{i}", "qa", (), prompt_ids=[3, 4, 5],
                   response_ids=list(range(6, 10)), loss_mask=[1] * 4, logprobs=[-1.0] * 4)
        for i in range(2)
    ]  # fmt: skip
    losses = {}
    for correction, engine_gap in (("none", 0.0), ("truncate", 0.0), ("truncate", -math.log(4.0))):
        algo = replace(fleet_cfg.algo, behaviour_correction=correction, behaviour_cap=2.0)
        cfg = replace(fleet_cfg, algo=algo, learner=replace(fleet_cfg.learner, world_size=1))
        with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
            batch = LearnerBatch.from_trajectories(trajs, pad_token_id(tiny_model_dir), behaviour=correction != "none")
            old = from_numpy(rank.forward_old([batch])["passes"][0][0])
            full = batch.with_signal({"advantage": [1.0, -2.0], "shaping": [1.0, 1.0]})
            full.old_logprobs = old
            if full.behaviour_logprobs is not None:
                full.behaviour_logprobs = (old + engine_gap) * full.loss_mask
            stats = merge_actor_stats([rank.update([([full], 8.0)])])
            losses[(correction, engine_gap)] = stats
    plain, same, stale = losses.values()
    assert same["loss_sum"] == pytest.approx(plain["loss_sum"], rel=1e-6) and same["behaviour_weight_mean"] == 1.0
    assert stale["loss_sum"] == pytest.approx(2 * plain["loss_sum"], rel=1e-5)
    assert stale["behaviour_weight_mean"] == pytest.approx(2.0) and stale["behaviour_capped_frac"] == 1.0
    assert "behaviour_weight_mean" not in plain


def test_forward_old_puts_sorted_micro_batches_back_in_row_order(ray_session, fleet_cfg):
    """With balanced (the default) or length-sorted micro-batches a rank sees its rows out of order; the group must
    still fill ``old_logprobs`` / ``entropies`` row by row (ranks here echo each row's length and slot)."""
    from dataclasses import replace

    from rapo_ray.types.batch import TrajectoryBatch
    from rapo_ray.workers.learner import LearnerGroup

    @ray.remote(num_cpus=0)
    class Echo:
        def forward_old(self, micro_batches):
            """Each row's response positions hold its response length (log-probs) and its row index (entropies)."""
            passes = [
                (
                    (mb.response_mask * (mb.length - mb.prompt_len)[:, None]).numpy(),
                    (mb.response_mask * mb.row[:, None]).numpy(),
                )
                for mb in micro_batches
            ]
            return {"passes": passes, "cpu_s": 0.5}

    lengths = [30, 3, 4, 31, 5, 29, 6, 2, 33]
    trajs = _trajectories_of_lengths(lengths)
    group = LearnerGroup.__new__(LearnerGroup)
    group.workers, group.pad_id = [Echo.remote(), Echo.remote()], 0
    for balanced, length_sorted in ((True, False), (False, True), (False, False)):
        learner = replace(
            fleet_cfg.learner,
            world_size=2,
            mini_batch_size=8,
            balanced_micro_batches=balanced,
            length_sorted_micro_batches=length_sorted,
        )
        group.cfg = replace(fleet_cfg, learner=learner)
        batch = TrajectoryBatch(trajs)
        padded = group.forward_old(batch)
        lb = batch.learner
        if balanced:
            # rows of 2 + n tokens, micro-batches of 4: rank 0 the four longest (4 x 35) and a 2-token padding row,
            # rank 1 the next four (4 x 8) and the shortest row (1 x 4)
            assert padded == {
                "padded_tokens": 142 + 36,
                "slowest_rank_padded_tokens": 142,
                "cpu_s": 1.0,
            }  # 2 ranks x 0.5
        assert [set(lb.response_values("old_logprobs", i).tolist()) for i in range(len(lengths))] == [
            {float(n)} for n in lengths
        ]
        assert [set(lb.response_values("entropies", i).tolist()) for i in range(len(lengths))] == [
            {float(i)} for i in range(len(lengths))
        ]
        assert float((lb.old_logprobs * (1 - lb.response_mask)).abs().sum()) == 0  # nothing outside the rows' targets


def test_update_deals_each_mini_batch_to_the_ranks_balanced(ray_session, fleet_cfg):
    """learner.balanced_micro_batches (the default): a PPO mini-batch reaches the ranks whole, every row once with
    the mini-batch's global denominator, and the rank that gets the long rows gets fewer of them (ranks here keep
    the rows they were sent)."""
    from dataclasses import replace

    from rapo_ray.types.batch import TrajectoryBatch
    from rapo_ray.workers.learner import LearnerGroup

    @ray.remote(num_cpus=0)
    class Record:
        def update(self, mini_batches):
            self.sent = [([mb.row.tolist() for mb in mbs], denominator) for mbs, denominator in mini_batches]
            return {}

        def received(self):
            return self.sent

    lengths = [40, 3, 4, 5, 38, 6, 7, 8]  # two long responses among six short ones; prompts are 2 tokens
    trajs = _trajectories_of_lengths(lengths)
    group = LearnerGroup.__new__(LearnerGroup)
    group.workers, group.pad_id = [Record.remote(), Record.remote()], 0
    group.cfg = replace(fleet_cfg, learner=replace(fleet_cfg.learner, world_size=2, mini_batch_size=8, ppo_epochs=1))
    batch = TrajectoryBatch(trajs)
    batch.learner = LearnerBatch.from_trajectories(trajs, 0)
    batch.learner.old_logprobs = torch.zeros_like(batch.learner.response_mask)
    batch.learner = batch.learner.with_signal({"advantage": [1.0] * 8, "shaping": [1.0] * 8})
    group.update(batch, step=1)
    ((long_rank, denominator),), ((short_rank, other_denominator),) = sorted(
        (ray.get(w.received.remote()) for w in group.workers), key=lambda sent: len(sent[0][0][0])
    )
    assert denominator == other_denominator == float(sum(lengths))  # every loss token of the mini-batch
    assert sorted(long_rank[0]) == [0, 4] and sorted(short_rank[0]) == [1, 2, 3, 5, 6, 7]  # 2 x 42 vs 6 x 10 tokens


def test_checkpoint_in_a_lower_dtype_keeps_fp32_master_weights(rank_host, fleet_cfg, tiny_model_dir, tmp_path):
    """model.dtype=bfloat16: the checkpoint is an HF folder in bf16 (what engines and serving load), and a resume
    continues from the exact fp32 master weights kept in optimizer.pt, not from their bf16 rounding."""
    from dataclasses import replace

    from safetensors import safe_open

    from rapo_ray.model.factory import load_model

    cfg = replace(
        fleet_cfg,
        model=replace(fleet_cfg.model, dtype="bfloat16"),
        learner=replace(fleet_cfg.learner, lr=3e-3, world_size=1),
    )
    trajs = [
        Trajectory(f"g{i}", i, "on_policy", f"p{i}", "qa", (), prompt_ids=[3, 4, 5],
                   response_ids=list(range(6, 12 + i)), loss_mask=[1] * (6 + i))
        for i in range(2)
    ]  # fmt: skip
    batch = LearnerBatch.from_trajectories(trajs, pad_token_id(tiny_model_dir)).with_signal(
        {"advantage": [1.0, -1.0], "shaping": [1.0, 1.0]}
    )
    path = tmp_path / "step-1"
    with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
        batch.old_logprobs = from_numpy(rank.forward_old([batch])["passes"][0][0])
        rank.update([([batch], 13.0)])
        trained = rank.full_state_dict()
        assert rank.save_checkpoint(str(path), str(tiny_model_dir))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    hf = load_model(path, dtype="bfloat16")
    assert torch.equal(hf.model.norm.weight, trained["model.norm.weight"].to(torch.bfloat16))
    blob = torch.load(path / "optimizer.pt", weights_only=True)
    assert all(torch.equal(blob["master"][k], v) for k, v in trained.items())
    with learner_rank(rank_host, tiny_model_dir, cfg) as rank:
        rank.load_checkpoint(str(path))
        resumed = rank.full_state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in trained.items())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in trained.values())  # bf16 would lose bits
