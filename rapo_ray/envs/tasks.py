"""Bundled synthetic task families, seeded, with disjoint train/test splits and a scripted expert.

- ``arith``: multi-step arithmetic word problems whose numbers are too large to do "in the head" of a
  small model: the expert writes one python call per operation.
- ``multihop``: 2-3 hop questions over a generated fact corpus ("the mentor of the rival of X"): the
  expert issues one search per hop.
- ``alias``: the same questions asked with words the corpus never uses ("the foe of the kin of X"; the
  corpus says "rival" and "sibling"). Searching the question's own words finds the wrong facts; the expert
  searches the corpus relation. The warm start shows this move rarely (``trainer.sft_family_examples``), so
  the policy seldom samples it: the family where a retrieved expert step of another question can show a move
  the policy lacks (issue 21; TASK_DESIGN_NOTES).

The expert's trajectories are written in the protocol (``rapo_ray.types.protocol``); the tool results in
them come from the real tools when the agent loop replays them (issue 3), here from the generator itself.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field

from rapo_ray.types.protocol import ANSWER, PYTHON, RESULT, SEARCH, THINK


@dataclass(frozen=True)
class Problem:
    id: str
    family: str
    question: str
    answers: tuple[str, ...]
    # Expert solution as (thought, tool, call, result) steps; tool in {"python", "search"}; then the answer.
    expert_steps: tuple = field(default=(), compare=False)


# ---------------------------------------------------------------- arith

_NAMES = [
    "Ava",
    "Ben",
    "Cara",
    "Dev",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivo",
    "Jun",
    "Kai",
    "Lea",
    "Max",
    "Nia",
    "Oto",
    "Pia",
]
_ITEMS = ["apples", "coins", "books", "stamps", "shells", "cards", "pens", "beads"]


def _arith_problem(rng: random.Random, idx: int, split: str, ops: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(100, 999)
    sentences = [f"{name} has {total} {item}."]
    steps = []
    for _ in range(ops):
        kind = rng.choice(["box", "give", "get"])
        if kind == "box":
            n, k = rng.randint(3, 29), rng.randint(11, 99)
            sentences.append(f"{name} buys {n} boxes of {k} {item}.")
            expr, new = f"{total} + {n} * {k}", total + n * k
        elif kind == "give" and total > 200:
            k = rng.randint(11, total - 100)
            sentences.append(f"{name} gives away {k} {item}.")
            expr, new = f"{total} - {k}", total - k
        else:
            k = rng.randint(101, 999)
            sentences.append(f"{name} finds {k} more {item}.")
            expr, new = f"{total} + {k}", total + k
        steps.append((f"compute {expr}", "python", f"print({expr})", str(new)))
        total = new
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(f"arith-{split}-{idx}", "arith", " ".join(sentences), (str(total),), tuple(steps))


# ---------------------------------------------------------------- multihop

_RELATIONS = ["mentor", "rival", "sibling", "neighbor", "partner"]
_SYLL = ["ka", "lo", "mi", "ra", "tu", "ve", "zo", "ne", "pa", "si", "do", "re", "fu", "ga", "hi", "jo"]


def _entity_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(_SYLL) for _ in range(3)).capitalize())
    return sorted(names)


@dataclass
class FactWorld:
    """A random knowledge base: relation(entity) -> entity, and one document per fact."""

    entities: list[str]
    facts: dict  # (relation, entity) -> entity

    def documents(self) -> list[str]:
        return [f"The {rel} of {ent} is {obj}." for (rel, ent), obj in sorted(self.facts.items())]


def make_world(seed: int, num_entities: int = 200) -> FactWorld:
    rng = random.Random(seed)
    ents = _entity_names(rng, num_entities)
    facts = {(rel, e): rng.choice([x for x in ents if x != e]) for e in ents for rel in _RELATIONS}
    return FactWorld(ents, facts)


# Question word -> the corpus relation it means. "mentor" has no alias: the lexical search ranks ties in document
# order and mentor facts come first, so a search with an unknown word would land on the right mentor fact by luck.
ALIASES = {"foe": "rival", "kin": "sibling", "ally": "partner", "local": "neighbor"}


def _multihop_problem(
    rng: random.Random, world: FactWorld, idx: int, split: str, hops: int, family: str = "multihop"
) -> Problem:
    start = rng.choice(world.entities)
    words = [rng.choice(sorted(ALIASES) if family == "alias" else _RELATIONS) for _ in range(hops)]
    cur, steps = start, []
    for word in words:
        rel = ALIASES.get(word, word)
        nxt = world.facts[(rel, cur)]
        steps.append((f"find the {rel} of {cur}", "search", f"{rel} of {cur}", f"The {rel} of {cur} is {nxt}."))
        cur = nxt
    phrase = start
    for word in words:
        phrase = f"the {word} of {phrase}"
    return Problem(f"{family}-{split}-{idx}", family, f"Who is {phrase}?", (cur,), tuple(steps))


# ---------------------------------------------------------------- families


@dataclass(frozen=True)
class TaskFamily:
    name: str
    tool: str
    description: str


TASK_FAMILIES = {
    "arith": TaskFamily("arith", "python", "multi-step arithmetic word problems (python tool)"),
    "multihop": TaskFamily("multihop", "search", "2-3 hop questions over a generated fact corpus (search tool)"),
    "alias": TaskFamily(
        "alias", "search", "multihop questions worded with relation names the corpus never uses (search tool)"
    ),
}


def _is_test_question(question: str) -> bool:
    return zlib.crc32(question.encode()) % 8 == 0


def generate(
    family: str, split: str, size: int, seed: int, difficulty: int | None = None, world: FactWorld | None = None
) -> list[Problem]:
    """Generate ``size`` problems. Train and test use different seeds and are de-duplicated by question."""
    if family not in TASK_FAMILIES:
        raise ValueError(f"unknown task family {family!r}; valid: {sorted(TASK_FAMILIES)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{family}:{split}:{seed}")
    out, seen = [], set()
    if family in ("multihop", "alias"):
        world = world or make_world(seed)
    while len(out) < size:
        if family == "arith":
            p = _arith_problem(rng, len(out), split, difficulty or rng.choice([2, 3]))
        else:
            p = _multihop_problem(rng, world, len(out), split, difficulty or rng.choice([2, 3]), family)
        # Disjoint splits whatever their sizes: a question's hash decides its split (1 in 8 is test).
        if p.question not in seen and _is_test_question(p.question) == (split == "test"):
            seen.add(p.question)
            out.append(p)
    return out


def expert_parts(problem: Problem) -> list[tuple[bool, str]]:
    """The expert's response in protocol text as ``(is_policy_step, text)`` segments: each step's thought and tool
    call (the policy's), then the tool's recorded result (the environment's), and the boxed answer last."""
    parts = []
    for thought, tool, call, result in problem.expert_steps:
        open_t, close_t = PYTHON if tool == "python" else SEARCH
        parts.append((True, f"{THINK[0]}{thought}{THINK[1]}{open_t}{call}{close_t}"))
        parts.append((False, f"{RESULT[0]}{result}{RESULT[1]}"))
    parts.append((True, f"{THINK[0]}done{THINK[1]}{ANSWER[0]}\\boxed{{{problem.answers[0]}}}{ANSWER[1]}"))
    return parts


def expert_text(problem: Problem) -> str:
    """The expert's response in protocol text (what an SFT demonstration or a buffer trajectory looks like)."""
    return "".join(text for _, text in expert_parts(problem))


# ---------------------------------------------------------------- a question's solution path, read from its words

_ARITH_OPS = re.compile(r"(buys (\d+) boxes of (\d+))|(gives away (\d+))|(finds (\d+) more)")
_ARITH_START = re.compile(r"^\w+ has (\d+) ")
_HOP = re.compile(r"the (\w+) of ")


def arith_plan(question: str) -> tuple[int, list[str]] | None:
    """(start value, python operations in order) of an arith question; None for another family."""
    m = _ARITH_START.match(question)
    if not m:
        return None
    ops = []
    for g in _ARITH_OPS.finditer(question):
        if g.group(1):
            ops.append(f"+ {g.group(2)} * {g.group(3)}")
        elif g.group(4):
            ops.append(f"- {g.group(5)}")
        else:
            ops.append(f"+ {g.group(7)}")
    return int(m.group(1)), ops


def multihop_plan(question: str) -> tuple[str, list[str]] | None:
    """(start entity, corpus relations in search order); an alias family's words are mapped to the corpus's."""
    if not question.startswith("Who is "):
        return None
    rels = [ALIASES.get(word, word) for word in _HOP.findall(question)]
    start = question.rstrip("?").rsplit(" of ", 1)[-1]
    return start, list(reversed(rels))
