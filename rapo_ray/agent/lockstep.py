"""The lockstep schedule: all live trajectories advance together, one turn at a time. Per turn: the
retrievals the rollout policy asks for, in one batch; one batched ``engine.generate`` for every live
trajectory; the turn's tool calls, concurrently; then the policy's ``after_tool`` (ARPO branching)."""

from __future__ import annotations

import time

from rapo_ray.agent.turns import AgentTurns, RolloutStats
from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.types.trajectory import ON_POLICY, Retrieval, Task, Trajectory


def run_lockstep(
    turns: AgentTurns,
    trajs: list[Trajectory],
    stats: RolloutStats,
    rollout: RolloutPolicy,
    tasks_by_group: dict[str, Task],
) -> list[Trajectory]:
    pending_retrieval: dict[int, Retrieval] = {}
    while True:
        active = [i for i, t in enumerate(trajs) if not t.finished]
        if not active:
            refill = rollout.refill(trajs)
            for gid, n in refill.items():
                turns.add_samples(trajs, tasks_by_group[gid], gid, [ON_POLICY] * n)
            if refill:
                continue
            break
        stats.turns += 1
        # 1. retrievals, where the rollout policy asks for one
        want = [i for i in active if turns.retriever is not None and rollout.wants_retrieval(trajs[i], turns.rng)]
        if want:
            t0 = time.perf_counter()
            turns.insert_retrievals(trajs, want, pending_retrieval)
            stats.retrieve_s += time.perf_counter() - t0
        # 2. one policy step for every live trajectory
        prompts, params, rows = [], [], []
        for i in active:
            t = trajs[i]
            room = turns.room(t)
            if room <= 0:  # out of response budget or context (a prompt longer than the window ends here)
                turns.finish(t, "length")
                continue
            prompts.append(t.token_ids())
            params.append(turns.step_params(room, turns.rng))
            rows.append(i)
        if not rows:
            continue
        t0 = time.perf_counter()
        results = turns.engine.generate(prompts, params)
        stats.generate_s += time.perf_counter() - t0
        stats.engine_calls += 1
        calls: list[tuple[int, str, str]] = []
        for i, res in zip(rows, results):
            call = turns.take_step(trajs[i], res, pending_retrieval.pop(i, None))
            if call is not None:
                calls.append((i, *call))
        # 3. tools, concurrently
        if calls:
            t0 = time.perf_counter()
            turns.run_tools(trajs, calls)
            stats.tool_s += time.perf_counter() - t0
        # 4. the algorithm's reaction to the tool results (ARPO: entropy-guided forks)
        rollout.after_tool(trajs, [i for i, _, _ in calls])
    for t in trajs:
        turns.score(t, rollout)
    return trajs
