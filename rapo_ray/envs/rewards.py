"""Reward scoring: answer extraction, exact match / F1 with the usual normalisation, math equivalence, and
the ARPO format rule (invalid format = -1).

Everything is scored on policy-generated text only: callers pass the concatenated generated segments, so
tool results and retrieved blocks can never earn reward or format credit.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from rapo_ray.types.protocol import ANSWER, PYTHON, RETRIEVE, SEARCH, THINK, extract_boxed

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _light_normalize(text: str) -> str:
    """Lower case, no punctuation, single spaces: for a gold answer that SQuAD normalisation empties (an article
    alone, "A"), where dropping articles would make every article, or an empty answer, match it."""
    return " ".join("".join(ch for ch in text.lower() if ch not in _PUNCT).split())


def _normalized_pair(prediction: str, gold: str) -> tuple[str, str]:
    """(prediction, gold) normalised alike: SQuAD's rule, or the light one when SQuAD's leaves the gold empty. A gold
    that is empty either way comes back empty, and the callers let it match nothing."""
    g = normalize_answer(gold)
    if g:
        return normalize_answer(prediction), g
    return _light_normalize(prediction), _light_normalize(gold)


def exact_match(prediction: str, answers) -> float:
    for a in _as_list(answers):
        pred, gold = _normalized_pair(prediction, a)
        if gold and pred == gold:
            return 1.0
    return 0.0


def token_f1(prediction: str, answers) -> float:
    """Max token F1 over the gold aliases."""
    best = 0.0
    for a in _as_list(answers):
        pred, gold_text = _normalized_pair(prediction, a)
        pred_tokens, gold = pred.split(), gold_text.split()
        common = Counter(pred_tokens) & Counter(gold)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        p, r = overlap / len(pred_tokens), overlap / len(gold)
        best = max(best, 2 * p * r / (p + r))
    return best


def _as_list(answers) -> list[str]:
    if isinstance(answers, str):
        return [answers]
    return [str(a) for a in answers]


# ---------------------------------------------------------------- math

_LATEX_WRAPPERS = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", "$", r"\displaystyle"]
_TEXT_CMD = re.compile(r"\\(?:text|mathrm|mbox|textbf)\{([^{}]*)\}")
# a unit in \text{} (or \mathrm, \mbox) right after a number: dropped, so "70 \text{ cm}" equals "70"
_UNIT_AFTER_NUMBER = re.compile(r"(\d)\s*\\(?:text|mathrm|mbox)\{\s*[A-Za-z][^{}]*\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_SQRT = re.compile(r"\\sqrt\{([^{}]+)\}")


def _strip_math(s: str) -> str:
    s = s.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    for w in _LATEX_WRAPPERS:
        s = s.replace(w, "")
    s = _UNIT_AFTER_NUMBER.sub(r"\1", s)  # "70 \text{ cm}" -> "70": a unit after a quantity
    s = _TEXT_CMD.sub(r"\1", s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace(",\\!", "")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _SQRT.sub(r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("{", "(").replace("}", ")")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    # "x = 5" -> "5"; thousands separators "1,234" -> "1234"
    if "=" in s and s.count("=") == 1:
        s = s.split("=")[1]
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _to_number(s: str) -> Fraction | None:
    s = s.strip("()")
    m = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return None if den == 0 else Fraction(m.group(1)) / den
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(prediction: str, answer: str) -> bool:
    """Numeric equivalence (integers, decimals, fractions, \\frac, thousands separators, units in \\text)
    and otherwise equality of the normalised LaTeX strings."""
    a, b = _strip_math(prediction), _strip_math(answer)
    if a == b and a != "":
        return True
    na, nb = _to_number(a), _to_number(b)
    if na is not None and nb is not None:
        return abs(float(na) - float(nb)) <= 1e-6 * max(1.0, abs(float(nb)))
    return a.lower() == b.lower() and a != ""


# ---------------------------------------------------------------- format + reward

_PAIRS = [THINK, PYTHON, SEARCH, ANSWER]


def format_ok(generated_text: str) -> tuple[bool, str]:
    """ARPO-style format check on policy-generated text: balanced, non-nested tag pairs, exactly one
    answer block, a \\boxed{} inside it, and no <retrieve> written by the policy."""
    if RETRIEVE[0] in generated_text or RETRIEVE[1] in generated_text:
        return False, "policy wrote a retrieve tag"
    for open_t, close_t in _PAIRS:
        if generated_text.count(open_t) != generated_text.count(close_t):
            return False, f"unbalanced {open_t}"
    depth_tag = None
    for m in re.finditer(r"</?(think|python|search|answer)>", generated_text):
        tag, closing = m.group(1), m.group(0).startswith("</")
        if not closing:
            if depth_tag is not None:
                return False, f"<{tag}> nested in <{depth_tag}>"
            depth_tag = tag
        else:
            if depth_tag != tag:
                return False, f"</{tag}> without an open <{tag}>"
            depth_tag = None
    if generated_text.count(ANSWER[0]) != 1:
        return False, "needs exactly one <answer>"
    answer_block = generated_text.split(ANSWER[0], 1)[1].split(ANSWER[1], 1)[0]
    if extract_boxed(answer_block) is None:
        return False, "no \\boxed{} in the answer"
    return True, ""


def extract_answer(generated_text: str) -> str | None:
    if ANSWER[0] not in generated_text:
        return extract_boxed(generated_text)
    block = generated_text.rsplit(ANSWER[0], 1)[1].split(ANSWER[1], 1)[0]
    return extract_boxed(block)


@dataclass
class Score:
    reward: float
    correct: bool  # exact match (QA) or equivalence (math)
    f1: float
    format_ok: bool
    answer: str | None
    reason: str = ""


def score(generated_text: str, answers, kind: str = "qa", tool_bonus: float = 0.0) -> Score:
    """The training reward (ARPO's rule): -1 for invalid format, else F1 (QA) or 1/0 (math), optionally
    + ``tool_bonus`` when the answer is right and both python and search were used."""
    ok, reason = format_ok(generated_text)
    pred = extract_answer(generated_text)
    if kind == "math":
        correct = pred is not None and any(math_equal(pred, a) for a in _as_list(answers))
        f1 = float(correct)
    else:
        correct = pred is not None and bool(exact_match(pred, answers))
        f1 = token_f1(pred, answers) if pred is not None else 0.0
    if not ok:
        return Score(-1.0, correct, f1, False, pred, reason)
    reward = f1
    if tool_bonus and f1 > 0 and PYTHON[1] in generated_text and SEARCH[1] in generated_text:
        reward += tool_bonus
    return Score(reward, correct, f1, True, pred)
