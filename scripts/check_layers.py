"""Check that ``rapo_ray``'s folders are layers: every import points down or sideways, and no imports go in a circle.

    python scripts/check_layers.py        # prints each upward import and each circle; exits 1 if there is one

Each folder under ``rapo_ray/`` is one layer (``LAYERS``, bottom to top); a module may import its own layer or a
lower one. Every ``import`` / ``from ... import`` of a ``rapo_ray`` module counts, those inside functions included.
Sideways imports are allowed, but no set of modules may import each other in a circle. A module outside every layer
folder (a new file straight under ``rapo_ray/``, a new folder) is an error: place it. docs/ARCHITECTURE.md explains
the layers.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. Folders on one line are one layer (they may import each other, but not in a circle).
LAYERS: list[tuple[str, ...]] = [
    ("core",),  # errors, loopback networking, devices, metric reduction
    ("types",),  # tag protocol, trajectories, the environment protocol, the learner batch
    ("algos",),  # the learning signal (pure torch), each algorithm's rollout hooks, the algorithm registry
    ("config",),  # typed configuration (validates the algorithm through the registry)
    ("envs", "engines"),  # tasks, tools, rewards, data loaders | inference engines
    ("model", "agent"),  # model and tokenizer loading | the multi-turn agent loop and evaluation
    ("retrieval",),  # embedder, Milvus store, search indexes, the Serve retrieval deployment
    ("pipelines", "serving"),  # scripted expert, warm start, step buffer | serving the trained agent
    ("workers",),  # Ray actors: rollout fleet, learner group, weight sync
    ("training",),  # the RL step (Trainer), its Ray Data stage, checkpoints, reporting
    ("launch",),  # the Ray topology of a run, resource plans, the command line
]


def layer_of(module: str) -> int | None:
    """The layer of a ``rapo_ray`` module: its first folder's; the package itself is the bottom."""
    parts = module.split(".")
    if parts == ["rapo_ray"]:
        return 0
    for rank, folders in enumerate(LAYERS):
        if len(parts) >= 2 and parts[1] in folders:
            return rank
    return None


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


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, for every module under rapo_ray/."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted((ROOT / "rapo_ray").rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = graph.setdefault(name, {})
        for line, target in imported_modules(ast.parse(path.read_text(), str(path)), package):
            if target != name:
                edges.setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan), each sorted; a module importing itself is not one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    sys.setrecursionlimit(10_000)
    graph = import_graph()
    problems = []
    for name, edges in sorted(graph.items()):
        src = layer_of(name)
        path = ROOT / Path(*name.split("."))
        shown = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if src is None:
            problems.append(f"{name}: in no layer folder (move it into one, or add its folder to LAYERS)")
            continue
        for target, line in sorted(edges.items()):
            dst = layer_of(target)
            if dst is not None and dst > src:
                problems.append(
                    f"{shown.relative_to(ROOT)}:{line}: {name} ({'/'.join(LAYERS[src])}) imports {target} "
                    f"({'/'.join(LAYERS[dst])}), a higher layer"
                )
    loops = circles(graph)
    for members in loops:
        ties = [f"{a} -> {b}" for a in members for b in graph[a] if b in members]
        problems.append(f"circle of {len(members)} modules: {'; '.join(ties)}")
    for p in problems:
        print(p)
    n_up = len(problems) - len(loops)
    print(f"layers: {len(graph)} modules, {sum(map(len, graph.values()))} imports, {n_up} upward, {len(loops)} circles")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
