"""Loaders for real data, normalised to ``Example(id, question, answers, kind, source)``.

Shapes handled (any file of these shapes loads, not only the shipped ones):
- verl parquet (Tool-Star/ARPO RL sets): ``prompt`` = list of {role, content}, ``reward_model.ground_truth``,
  ``ability`` (math | qa), ``extra_info.question``;
- jsonl with a question under ``question`` | ``problem`` | ``Question`` and an answer under ``answer`` |
  ``Final answer`` as a string, a list of aliases, or a GSM8K rationale ending in ``#### x``.
A malformed row raises ``DataError`` naming file, row and field, or is skipped and counted when
``skip_bad_rows`` is set.

Also: GSM8K gold solutions converted to protocol trajectories whose steps are python calls taken from the
``<<a*b=c>>`` calculator annotations, real off-policy step traces for the python tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from rapo_ray.core.errors import DataError
from rapo_ray.envs.rewards import math_equal
from rapo_ray.types.protocol import ANSWER, PYTHON, RESULT, THINK

MATH_SOURCES = {"gsm8k", "math500", "aime24", "aime25", "math"}
QUESTION_KEYS = ("question", "problem", "Question")
ANSWER_KEYS = ("answer", "Final answer", "final_answer")


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: tuple[str, ...]
    kind: str  # "math" | "qa"
    source: str


@dataclass
class LoadReport:
    path: str
    loaded: int = 0
    skipped: int = 0  # malformed rows skipped (skip_bad_rows)
    filtered: int = 0  # well-formed rows left out by calc_steps
    errors: list[str] = field(default_factory=list)


def _kind_for(path: Path, row: dict) -> str:
    ability = row.get("ability")
    if ability in ("math", "qa"):
        return ability
    name = path.parent.name.lower() if path.name.startswith("test") else path.stem.lower()
    return "math" if any(s in name for s in MATH_SOURCES) else "qa"


def _answers_from(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        if "####" in value:  # GSM8K rationale
            value = value.rsplit("####", 1)[1]
        value = value.strip()
        if not value:
            raise DataError(f"{where}: empty answer")
        return (value,)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (str(value),)
    if isinstance(value, list) and value and all(isinstance(v, (str, int, float)) for v in value):
        aliases = tuple(str(v).strip() for v in value)
        empty = [i for i, a in enumerate(aliases) if not a]
        if empty:  # an empty alias would make an empty answer correct
            raise DataError(f"{where}: answer alias {empty[0]} is empty")
        return aliases
    raise DataError(f"{where}: answer must be a string or a non-empty list of strings, got {type(value).__name__}")


def _row_to_example(path: Path, idx: int, row: dict, source: str, ordinal: int | None = None) -> Example:
    """``idx``: the row's number in errors (a jsonl file's line, blank lines counted; a parquet row); ``ordinal``:
    its place among the file's rows, the id of a row without one (``idx`` when not given)."""
    where = f"{path}: row {idx}"
    ordinal = idx if ordinal is None else ordinal
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    if "prompt" in row and "reward_model" in row:  # verl format
        rm = row.get("reward_model") or {}
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise DataError(f"{where}: field 'reward_model.ground_truth' missing")
        extra = row.get("extra_info") or {}
        question = extra.get("question") if isinstance(extra, dict) else None
        if not question:
            msgs = row.get("prompt")
            users = [m.get("content") for m in msgs or [] if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                raise DataError(f"{where}: field 'prompt' has no user message and 'extra_info.question' is missing")
            question = users[-1]
        answers = _answers_from(rm["ground_truth"], f"{where}: field 'reward_model.ground_truth'")
        ex_id = f"{source}-{extra.get('index', ordinal) if isinstance(extra, dict) else ordinal}"
    else:
        qkey = next((k for k in QUESTION_KEYS if k in row), None)
        if qkey is None:
            raise DataError(f"{where}: no question field (tried {list(QUESTION_KEYS)}); fields present: {sorted(row)}")
        question = row[qkey]
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: field {qkey!r} must be a non-empty string")
        akey = next((k for k in ANSWER_KEYS if k in row), None)
        if akey is None:
            raise DataError(f"{where}: no answer field (tried {list(ANSWER_KEYS)}); fields present: {sorted(row)}")
        answers = _answers_from(row[akey], f"{where}: field {akey!r}")
        ex_id = f"{source}-{row.get('id', row.get('idx', ordinal))}"
    return Example(str(ex_id), question.strip(), answers, _kind_for(path, row), source)


def source_name(path: Path) -> str:
    """The family name of a file's examples: ``<name>/train.jsonl`` (or test, valid, dev) is ``name``."""
    return path.parent.name if path.stem in ("test", "train", "valid", "dev") else path.stem


def load_examples(
    path: str | Path, skip_bad_rows: bool = False, limit: int | None = None, calc_steps: tuple[int, ...] = ()
) -> tuple[list[Example], LoadReport]:
    """Load a .jsonl or .parquet file of questions and answers. ``calc_steps``: keep only the GSM8K-format rows whose
    rationale has one of these numbers of ``<<a*b=c>>`` calculator notes (``calc_note_count``; empty: every row); a row
    without a GSM8K rationale is then malformed. ``limit`` counts the rows kept. Ids are a row's place in the file,
    so a filtered subset keeps the ids the whole file gives."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {p} does not exist")
    report, out = LoadReport(str(p)), []
    source = source_name(p)
    rows = 0
    for ordinal, (line, row) in enumerate(_iter_rows(p)):
        rows += 1
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(row, DataError):
                raise row
            example = _row_to_example(p, line, row, source, ordinal)
            if calc_steps and calc_note_count(gsm8k_rationale(p, line, row)) not in calc_steps:
                report.filtered += 1
                continue
            out.append(example)
            report.loaded += 1
        except DataError as exc:
            if not skip_bad_rows:
                raise
            report.skipped += 1
            report.errors.append(str(exc))
    if rows == 0:
        raise DataError(f"data file {p} has no rows (it is empty or only blank lines)")
    return out, report


def gsm8k_rationale(path: Path, line: int, row: dict) -> str:
    """A GSM8K row's rationale (``answer``: the worked solution, then ``#### x``); ``DataError`` naming file and row
    when the row has none."""
    rationale = row.get("answer") if isinstance(row, dict) else None
    if not isinstance(rationale, str) or "####" not in rationale:
        raise DataError(f"{path}: row {line}: field 'answer' is not a GSM8K rationale ending in '#### <answer>'")
    return rationale


def _iter_rows(p: Path):
    """(row number, row or the DataError reading it) for every row; a jsonl row's number is its line's, blank lines
    counted, so every error about one line names the same number."""
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as exc:
            raise DataError(f"{p}: not a readable parquet file: {exc}") from exc
        idx = 0
        for batch in table.to_batches(max_chunksize=1024):
            for row in batch.to_pylist():
                yield idx, row
                idx += 1
    elif p.suffix in (".jsonl", ".json"):
        with open(p, encoding="utf-8") as f:
            for idx, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    yield idx, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield idx, DataError(f"{p}: row {idx}: invalid JSON: {exc.msg}")
    else:
        raise DataError(f"{p}: unsupported file type {p.suffix!r} (use .jsonl or .parquet)")


# ---------------------------------------------------------------- GSM8K gold solutions -> trajectories

_CALC = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


@dataclass(frozen=True)
class CalcStep:
    thought: str  # the solution sentence, annotation removed
    expression: str  # python expression from the annotation
    expected: str  # the annotated result


def gsm8k_calc_steps(solution: str) -> list[CalcStep]:
    """One step per ``<<expr=result>>`` annotation, with the sentence it appears in as the thought."""
    steps = []
    for line in solution.split("\n"):
        if line.startswith("####"):
            continue
        for m in _CALC.finditer(line):
            expr = m.group(1).replace("x", "*").replace("÷", "/").replace("^", "**").strip()
            thought = _CALC.sub("", line).strip()
            steps.append(CalcStep(thought, expr, m.group(2).strip()))
    return steps


def calc_note_count(rationale: str) -> int:
    """How many ``<<expr=result>>`` calculator notes a GSM8K rationale has: the solution's arithmetic steps, a
    difficulty measure (GSM8K's test split: 18 with none, 65 with 1, 357 with 2, 364 with 3, 515 with 4-8)."""
    return len(_CALC.findall(rationale))


def gsm8k_solutions(path: str | Path, limit: int | None, calc_steps: tuple[int, ...] = ()) -> list[tuple[Example, str]]:
    """The first ``limit`` rows (None: all) of a GSM8K-format file (``question``, ``answer`` = rationale then
    ``#### x``) as (example, rationale) pairs, only those with ``calc_steps`` calculator notes when given (as in
    ``load_examples``); a row without a rationale raises ``DataError`` naming file and row."""
    p, out = Path(path), []
    if not p.is_file():
        raise DataError(f"data file {p} does not exist")
    source, rows = source_name(p), 0
    for ordinal, (line, row) in enumerate(_iter_rows(p)):
        rows += 1
        if limit is not None and len(out) >= limit:
            break
        if isinstance(row, DataError):
            raise row
        example = _row_to_example(p, line, row, source, ordinal)
        rationale = gsm8k_rationale(p, line, row)
        if not calc_steps or calc_note_count(rationale) in calc_steps:
            out.append((example, rationale))
    if rows == 0:
        raise DataError(f"data file {p} has no rows (it is empty or only blank lines)")
    return out


def gsm8k_trajectory_parts(solution: str, answer: str, run_python) -> tuple[list[tuple[bool, str]], list[bool]]:
    """A GSM8K gold solution as protocol segments: each annotation becomes a policy step
    ``<think>sentence</think><python>print(expr)</python>`` followed by the ``<result>`` that ``run_python`` (the
    real sandbox) produces for it, then a final ``\\boxed{answer}`` step. Returns ``(is_policy_step, text)``
    segments and, per calculator step, whether the tool reproduced the annotated value."""
    parts, matches = [], []
    for step in gsm8k_calc_steps(solution):
        result = run_python(f"print({step.expression})")
        matches.append(result.ok and math_equal(result.text, step.expected))
        parts.append((True, f"{THINK[0]}{step.thought}{THINK[1]}{PYTHON[0]}print({step.expression}){PYTHON[1]}"))
        parts.append((False, f"{RESULT[0]}{result.text}{RESULT[1]}"))
    parts.append((True, f"{THINK[0]}done{THINK[1]}{ANSWER[0]}\\boxed{{{answer}}}{ANSWER[1]}"))
    return parts, matches


def gsm8k_to_trajectory_text(solution: str, answer: str, run_python) -> tuple[str, list[bool]]:
    """``gsm8k_trajectory_parts`` as one protocol text."""
    parts, matches = gsm8k_trajectory_parts(solution, answer, run_python)
    return "".join(text for _, text in parts), matches
