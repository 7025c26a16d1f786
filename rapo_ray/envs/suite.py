"""Assemble the environment of a run: task splits as loop ``Task``s and the tools they need (given a search index)."""

from __future__ import annotations

from pathlib import Path

from rapo_ray.envs import tasks as bundled
from rapo_ray.envs.loaders import load_examples
from rapo_ray.envs.tools import PythonSandbox, SandboxLimits, SearchTool, ToolSet
from rapo_ray.types.trajectory import Task

FAMILY_KIND = {"arith": "math", "multihop": "qa", "alias": "qa"}


def to_task(problem) -> Task:
    if isinstance(problem, bundled.Problem):
        return Task(problem.id, problem.question, tuple(problem.answers), FAMILY_KIND[problem.family])
    return Task(problem.id, problem.question, tuple(problem.answers), problem.kind)  # loaders.Example


def family_of(task_id: str) -> str:
    return task_id.split("-", 1)[0]


def dataset_name(path: str) -> str:
    """The family name of a data file's tasks: ``<name>/test.jsonl`` is ``name``, any other file its stem."""
    p = Path(path)
    return p.parent.name if p.name == "test.jsonl" else p.stem


def task_splits(tasks_cfg) -> tuple[dict[str, list[Task]], dict[str, list[Task]]]:
    """Train and test tasks per family (bundled families, then real data files as their own families).
    Bundled training splits mix 2- and 3-step problems (the warm start needs both); the test split has
    ``tasks.difficulty`` steps (0: mixed)."""
    train, test = {}, {}
    for fam in tasks_cfg.families:
        train[fam] = [to_task(p) for p in bundled.generate(fam, "train", tasks_cfg.train_size, tasks_cfg.seed)]
        test[fam] = [
            to_task(p)
            for p in bundled.generate(fam, "test", tasks_cfg.test_size, tasks_cfg.seed, tasks_cfg.difficulty or None)
        ]
    calc_steps = tuple(tasks_cfg.calc_steps)
    for path in tasks_cfg.data_files:
        examples, _ = load_examples(path, skip_bad_rows=tasks_cfg.skip_bad_rows, calc_steps=calc_steps)
        name = examples[0].source if examples else path
        train[name] = [to_task(e) for e in examples]
    for path in tasks_cfg.eval_files:
        examples, _ = load_examples(
            path, skip_bad_rows=tasks_cfg.skip_bad_rows, limit=tasks_cfg.eval_limit or None, calc_steps=calc_steps
        )
        test[dataset_name(path)] = [to_task(e) for e in examples]
    return train, test


def build_tools(tasks_cfg, rollout_cfg, search_index, max_concurrency: int = 2) -> ToolSet:
    """Python sandbox + search over ``search_index`` (anything with ``search(query, k)``; the run's is built by
    ``rapo_ray.retrieval.search_index.search_index_for``)."""
    limits = SandboxLimits(
        timeout_s=rollout_cfg.tool_timeout_s,
        cpu_s=max(1, int(rollout_cfg.tool_timeout_s)),
        output_chars=rollout_cfg.tool_output_chars,
    )
    return ToolSet(
        PythonSandbox(limits, max_concurrency, mode=rollout_cfg.python_sandbox, isolation=rollout_cfg.python_isolation),
        SearchTool(search_index, 3, rollout_cfg.tool_output_chars),
        max_concurrency,
    )


def task_difficulty(task: Task) -> int:
    """Number of tool steps the expert needs (bundled families); 0 when unknown."""
    plan = bundled.arith_plan(task.question) or bundled.multihop_plan(task.question)
    return len(plan[1]) if plan else 0
