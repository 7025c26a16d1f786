"""Check that imports inside ``rapo_ray`` point one way: a module may import its own layer or a lower one.

    python scripts/check_layers.py        # prints every upward import and exits 1 if there is one

Every ``import``/``from ... import`` of a ``rapo_ray`` module counts, function-local ones included. Each
module belongs to the layer of the longest prefix in ``LAYERS`` that matches its dotted name; a module that
matches none is an error too (a new module must be placed). docs/ARCHITECTURE.md explains the layers.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "rapo_ray",
            "rapo_ray.net",
            "rapo_ray.config",
            "rapo_ray.devices",
            "rapo_ray.metrics",
            "rapo_ray.checkpoints",
            "rapo_ray.agent.protocol",
            "rapo_ray.algos",
        ),
    ),
    (
        "types",
        (
            "rapo_ray.agent",
            "rapo_ray.agent.trajectory",
            "rapo_ray.agent.environment",
            "rapo_ray.agent.retriever",
            "rapo_ray.envs.tasks",
            "rapo_ray.batch",
        ),
    ),
    ("engines", ("rapo_ray.engines",)),
    ("agent loop", ("rapo_ray.agent.loop", "rapo_ray.evaluation")),
    (
        "environments and models",
        (
            "rapo_ray.envs",
            "rapo_ray.model",
            "rapo_ray.retrieval.embedder",
            "rapo_ray.retrieval.store",
            "rapo_ray.retrieval.replica_index",
        ),
    ),
    ("pipelines and services", ("rapo_ray.sft", "rapo_ray.retrieval", "rapo_ray.data_flow", "rapo_ray.serving")),
    ("actors", ("rapo_ray.rollout", "rapo_ray.learner", "rapo_ray.sync")),
    ("trainer", ("rapo_ray.trainer", "rapo_ray.reporting", "rapo_ray.sinks")),
    ("launcher", ("rapo_ray.launcher", "rapo_ray.plan", "rapo_ray.cli", "rapo_ray.ray_reaper")),
]


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = rank, len(p)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module) of every rapo_ray import; ``from rapo_ray.x import y`` counts y when y is a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("rapo_ray")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("rapo_ray"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    ROOT / Path(*sub.split("."))
                ).is_dir()
                out.append((node.lineno, sub if is_module else base))
    return out


def main() -> int:
    problems = []
    for path in sorted((ROOT / "rapo_ray").rglob("*.py")):
        name = module_name(path)
        src = layer_of(name)
        if src is None:
            problems.append(f"{name}: in no layer (add it to LAYERS in scripts/check_layers.py)")
            continue
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for line, target in imported_modules(ast.parse(path.read_text(), str(path)), package):
            dst = layer_of(target)
            if dst is not None and dst > src:
                problems.append(
                    f"{path.relative_to(ROOT)}:{line}: {name} ({LAYERS[src][0]}) imports {target} ({LAYERS[dst][0]})"
                )
    for p in problems:
        print(p)
    print(f"layers: {len(problems)} upward import(s)" if problems else "layers: every import points down or sideways")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
