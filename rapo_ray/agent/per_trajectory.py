"""The per-trajectory schedule: every trajectory is its own request stream (``engine.submit``). The main
thread reacts to whichever generation, tool call or retrieval finishes first and submits that trajectory's
next request, so tool calls overlap decoding instead of every trajectory waiting for the slowest of a turn.

Sampling seeds and retrieval draws come from a per-trajectory RNG, so they do not depend on the order in
which requests finish (the draws of a rollout policy's ``after_tool``, ARPO's branching, still do)."""

from __future__ import annotations

import random
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from rapo_ray.agent.turns import AgentTurns, RolloutStats, malformed_call_result
from rapo_ray.algos.rollout import RolloutPolicy
from rapo_ray.core.errors import RetrievalFailed
from rapo_ray.types.trajectory import ON_POLICY, Retrieval, Task, Trajectory


def run_per_trajectory(
    turns: AgentTurns,
    trajs: list[Trajectory],
    stats: RolloutStats,
    rollout: RolloutPolicy,
    tasks_by_group: dict[str, Task],
) -> list[Trajectory]:
    run_seed = turns.rng.randrange(2**31)
    rngs: dict[int, random.Random] = {}
    in_flight: dict = {}  # future -> (kind, trajectory index, started at)
    retrievals: dict[int, Retrieval] = {}
    generating = [0, 0.0]  # generations in flight, when the count last left 0
    retriever = turns.retriever
    retrieve_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="retrieve") if retriever is not None else None

    def rng_of(i: int) -> random.Random:
        if i not in rngs:
            rngs[i] = random.Random(f"{run_seed}:{trajs[i].group_id}:{trajs[i].slot}")
        return rngs[i]

    def start_turn(i: int) -> None:
        t = trajs[i]
        if retriever is not None and rollout.wants_retrieval(t, rng_of(i)):
            fut = retrieve_pool.submit(retriever.retrieve, [turns.query(t)], [t.problem_id])
            in_flight[fut] = ("retrieve", i, time.perf_counter())
            return
        start_generation(i)

    def start_generation(i: int) -> None:
        t = trajs[i]
        room = turns.room(t)
        if room <= 0:
            turns.finish(t, "length")
            return
        if generating[0] == 0:
            generating[1] = time.perf_counter()
        generating[0] += 1
        fut = turns.engine.submit(t.token_ids(), turns.step_params(room, rng_of(i)))
        in_flight[fut] = ("generate", i, time.perf_counter())

    def after_tool(i: int) -> None:
        n_before = len(trajs)
        if not trajs[i].finished:
            rollout.after_tool(trajs, [i])
        for j in [i] + list(range(n_before, len(trajs))):  # the trajectory, then any fork made from it
            if not trajs[j].finished:
                start_turn(j)

    try:
        for i in range(len(trajs)):
            start_turn(i)
        while True:
            if not in_flight:
                n_before = len(trajs)
                for gid, n in rollout.refill(trajs).items():
                    turns.add_samples(trajs, tasks_by_group[gid], gid, [ON_POLICY] * n)
                if len(trajs) > n_before:
                    for i in range(n_before, len(trajs)):
                        start_turn(i)
                    continue
                break
            done, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
            for fut in done:
                kind, i, started = in_flight.pop(fut)
                t = trajs[i]
                if kind == "retrieve":
                    stats.retrieve_s += time.perf_counter() - started
                    try:
                        r = turns.insert_retrieval(t, fut.result()[0])
                    except RetrievalFailed:
                        t.retrieval_errors += 1
                        r = None
                    if r is not None:
                        retrievals[i] = r
                    start_generation(i)
                elif kind == "generate":
                    generating[0] -= 1
                    if generating[0] == 0:
                        stats.generate_s += time.perf_counter() - generating[1]
                    stats.engine_calls += 1
                    call = turns.take_step(t, fut.result(), retrievals.pop(i, None))
                    if call is None:
                        continue
                    tool, content = call
                    malformed = malformed_call_result(content)
                    if malformed is not None:
                        turns.append_tool_result(t, malformed)
                        after_tool(i)
                    else:
                        in_flight[turns.tools.submit(tool, content)] = ("tool", i, time.perf_counter())
                else:  # tool
                    res = fut.result()
                    stats.tool_s += res.elapsed_s
                    turns.append_tool_result(t, res)
                    after_tool(i)
        stats.turns = max((t.num_generated_steps for t in trajs), default=0)
    finally:
        if retrieve_pool is not None:
            retrieve_pool.shutdown(wait=False, cancel_futures=True)
    for t in trajs:
        turns.score(t, rollout)
    return trajs
