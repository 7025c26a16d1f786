"""The recipe's multi-turn tool loop as a TRL ``rollout_func`` (benchmarks/peer_trl.py --tool-loop).

TRL's GRPOTrainer calls ``rollout_func(prompts, trainer)`` for each generation batch (one entry per completion: a
prompt appears once per generation of its group) and expects, per entry, the prompt's and the completion's token ids
and the completion's sampling log-probs; any other key reaches the reward functions, and ``env_mask`` (1 for a
token the model sampled, 0 for one the environment wrote) keeps tool results out of TRL's loss. Here the prompts are
task ids, and the completions come from our ``AgentLoop`` (the python sandbox, the paper's tags, the reward) on
TRL's own model, through our torch engine, which reads the live weights: TRL's updates reach the next rollout with
no copy.
"""

from __future__ import annotations

from typing import Callable, Sequence

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.engines.base import InferenceEngine
from rapo_ray.engines.torch_engine import TorchEngine
from rapo_ray.envs.suite import build_tools
from rapo_ray.types.trajectory import Task, Trajectory


def rollout_fields(trajectories: Sequence[Trajectory], group_ids: Sequence[str]) -> dict[str, list]:
    """TRL's rollout output for ``trajectories``, one per entry of ``group_ids`` (each entry its own group of one),
    in that order: ``prompt_ids`` [P_i], ``completion_ids`` [L_i] (generated tokens and tool results), ``logprobs``
    [L_i] (0 on tool-result tokens), ``env_mask`` [L_i] (our ``loss_mask``), and ``loop_reward`` / ``correct``, one
    each, for the reward function and the logs."""
    by_group = {t.group_id: t for t in trajectories}
    missing = [g for g in group_ids if g not in by_group]
    if missing or len(by_group) != len(group_ids):
        raise ValueError(f"the loop returned groups {sorted(by_group)} for entries {list(group_ids)}")
    ordered = [by_group[g] for g in group_ids]
    empty = [t.problem_id for t in ordered if len(t.response_ids) == 0]
    if empty:  # TRL reads each completion's last token
        raise ValueError(f"empty completions for {empty}")
    return {
        "prompt_ids": [t.prompt_ids.tolist() for t in ordered],
        "completion_ids": [t.response_ids.tolist() for t in ordered],
        "logprobs": [[float(x) for x in t.logprobs] for t in ordered],
        "env_mask": [t.loss_mask.tolist() for t in ordered],
        "loop_reward": [float(t.reward) for t in ordered],
        "correct": [bool(t.correct) for t in ordered],
    }


def torch_engine_on(model, tokenizer, max_batch_size: int) -> InferenceEngine:
    """Our torch engine on ``model`` itself (its live weights), leaving the model's train/eval mode as it was."""
    training = model.training
    engine = TorchEngine(model, tokenizer, max_batch_size=max_batch_size)
    model.train(training)  # the engine puts the model in eval mode; TRL's step sets the mode it needs
    return engine


def tool_loop_rollout(
    cfg, tokenizer, tasks_by_id: dict[str, Task], seed: int, engine_on: Callable = torch_engine_on
) -> Callable:
    """A ``rollout_func`` for the recipe ``cfg`` (a ``Config``): each prompt is a task id of ``tasks_by_id``. The
    loop is built on the first call, around the trainer's model (unwrapped from accelerate) through
    ``engine_on(model, tokenizer, max_batch_size)``. ``rollout.close()`` stops its python sandbox."""
    state: dict = {}

    def rollout(prompts: list, trainer) -> dict[str, list]:
        if "loop" not in state:
            model = trainer.accelerator.unwrap_model(trainer.model)
            engine = engine_on(model, tokenizer, max(len(prompts), 1))
            settings = LoopSettings.from_config(cfg)
            settings.seed = seed
            state["tools"] = build_tools(cfg.tasks, cfg.rollout, search_index=None)
            state["loop"] = AgentLoop(engine, tokenizer, state["tools"], settings)
        unknown = [p for p in prompts if p not in tasks_by_id]
        if unknown:
            raise ValueError(f"rollout_func: prompts {unknown[:3]} are not task ids of the recipe")
        group_ids = [f"{i}:{p}" for i, p in enumerate(prompts)]
        trajectories, _ = state["loop"].run_groups([tasks_by_id[p] for p in prompts], 1, group_ids)
        return rollout_fields(trajectories, group_ids)

    def close() -> None:
        if "tools" in state:
            state.pop("tools").close()

    rollout.close = close
    return rollout
