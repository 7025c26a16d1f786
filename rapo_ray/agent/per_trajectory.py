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
    """Roll ``trajs`` out to the end (their refills and forks included), then score them."""
    PerTrajectoryRun(turns, trajs, stats, rollout, tasks_by_group).run()
    for t in trajs:
        turns.score(t, rollout)
    return trajs


class PerTrajectoryRun:
    """One call of the schedule: the requests in flight and what happens when each kind finishes."""

    def __init__(
        self,
        turns: AgentTurns,
        trajs: list[Trajectory],
        stats: RolloutStats,
        rollout: RolloutPolicy,
        tasks_by_group: dict[str, Task],
    ):
        self.turns, self.trajs, self.stats, self.rollout, self.tasks_by_group = (
            turns,
            trajs,
            stats,
            rollout,
            tasks_by_group,
        )
        self.run_seed = turns.rng.randrange(2**31)
        self.rngs: dict[int, random.Random] = {}
        self.in_flight: dict = {}  # future -> (kind, trajectory index, started at)
        self.retrievals: dict[int, Retrieval] = {}
        self.generating, self.generating_since = 0, 0.0  # generations in flight, when the count last left 0
        self.retriever = turns.retriever
        self.retrieve_pool = None

    def run(self) -> None:
        if self.retriever is not None:
            self.retrieve_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="retrieve")
        try:
            for i in range(len(self.trajs)):
                self.start_turn(i)
            while self.in_flight or self.refill():
                if not self.in_flight:  # the refills finished at once (no room left): refill again
                    continue
                done, _ = wait(list(self.in_flight), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, i, started = self.in_flight.pop(fut)
                    {"retrieve": self.retrieved, "generate": self.generated, "tool": self.tool_done}[kind](
                        i, fut, started
                    )
            self.stats.turns = max((t.num_generated_steps for t in self.trajs), default=0)
        finally:
            if self.retrieve_pool is not None:
                self.retrieve_pool.shutdown(wait=False, cancel_futures=True)

    def rng_of(self, i: int) -> random.Random:
        if i not in self.rngs:
            self.rngs[i] = random.Random(f"{self.run_seed}:{self.trajs[i].group_id}:{self.trajs[i].slot}")
        return self.rngs[i]

    def refill(self) -> bool:
        """Nothing in flight: the rollout policy's refills (ARPO's full samples for unspent branch budget) start;
        False when there are none (the rollout is over)."""
        n_before = len(self.trajs)
        for gid, n in self.rollout.refill(self.trajs).items():
            self.turns.add_samples(self.trajs, self.tasks_by_group[gid], gid, [ON_POLICY] * n)
        for i in range(n_before, len(self.trajs)):
            self.start_turn(i)
        return len(self.trajs) > n_before

    def start_turn(self, i: int) -> None:
        t = self.trajs[i]
        if self.retriever is not None and self.rollout.wants_retrieval(t, self.rng_of(i)):
            fut = self.retrieve_pool.submit(self.retriever.retrieve, [self.turns.query(t)], [t.problem_id])
            self.in_flight[fut] = ("retrieve", i, time.perf_counter())
            return
        self.start_generation(i)

    def start_generation(self, i: int) -> None:
        t = self.trajs[i]
        room = self.turns.room(t)
        if room <= 0:
            self.turns.finish(t, "length")
            return
        if self.generating == 0:
            self.generating_since = time.perf_counter()
        self.generating += 1
        fut = self.turns.engine.submit(t.token_ids(), self.turns.step_params(room, self.rng_of(i)))
        self.in_flight[fut] = ("generate", i, time.perf_counter())

    def after_tool(self, i: int) -> None:
        n_before = len(self.trajs)
        if not self.trajs[i].finished:
            self.rollout.after_tool(self.trajs, [i])
        for j in [i] + list(range(n_before, len(self.trajs))):  # the trajectory, then any fork made from it
            if not self.trajs[j].finished:
                self.start_turn(j)

    def retrieved(self, i: int, fut, started: float) -> None:
        t = self.trajs[i]
        self.stats.retrieve_s += time.perf_counter() - started
        try:
            r = self.turns.insert_retrieval(t, fut.result()[0])
        except RetrievalFailed:
            t.retrieval_errors += 1
            r = None
        if r is not None:
            self.retrievals[i] = r
        self.start_generation(i)

    def generated(self, i: int, fut, started: float) -> None:
        self.generating -= 1
        if self.generating == 0:
            self.stats.generate_s += time.perf_counter() - self.generating_since
        self.stats.engine_calls += 1
        call = self.turns.take_step(self.trajs[i], fut.result(), self.retrievals.pop(i, None))
        if call is None:
            return
        tool, content = call
        malformed = malformed_call_result(content)
        if malformed is not None:
            self.turns.append_tool_result(self.trajs[i], malformed)
            self.after_tool(i)
        else:
            self.in_flight[self.turns.tools.submit(tool, content)] = ("tool", i, time.perf_counter())

    def tool_done(self, i: int, fut, started: float) -> None:
        res = fut.result()
        self.stats.tool_s += res.elapsed_s
        self.turns.append_tool_result(self.trajs[i], res)
        self.after_tool(i)
