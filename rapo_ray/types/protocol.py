"""The tag protocol of ARPO/RAPO (spec §1): think / python / search / result / answer, plus RAPO's retrieve."""

from __future__ import annotations

import re

from rapo_ray.core.errors import ModelLoadError

THINK = ("<think>", "</think>")
PYTHON = ("<python>", "</python>")
SEARCH = ("<search>", "</search>")
RESULT = ("<result>", "</result>")
ANSWER = ("<answer>", "</answer>")
RETRIEVE = ("<retrieve>", "</retrieve>")
ALL_TAGS = [t for pair in (THINK, PYTHON, SEARCH, RESULT, ANSWER, RETRIEVE) for t in pair]

# Chat-frame tokens of the bundled model. Real checkpoints bring their own chat template.
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
FRAME_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT]
SPECIAL_TOKENS = FRAME_TOKENS + ALL_TAGS

# Generation pauses on these (ARPO's stop strings); the loop runs the tool and appends the result.
TOOL_STOPS = (PYTHON[1], SEARCH[1])
ANSWER_STOP = ANSWER[1]

SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of tools. "
    "Think inside <think> </think>. To run code, write it inside <python> </python>; to look something up, "
    "write a query inside <search> </search>. The tool output is returned inside <result> </result>. "
    "Give the final answer inside <answer> </answer> with the answer in \\boxed{}. "
    # RAPO's one added sentence (spec §1).
    "Additional context may be enclosed in <retrieve> </retrieve> tags. Use it if helpful."
)

# The bundled small model learns the protocol in its warm start, so it needs no instructions; a short prompt
# keeps every sequence some 250 tokens shorter (much cheaper rollouts and updates on a CPU).
SHORT_SYSTEM_PROMPT = "Solve with tools. <retrieve> blocks hold context from other solutions."


def system_prompt_for(setting: str, bundled: bool) -> str:
    """``auto``: the short prompt for the bundled model, the paper's for real checkpoints."""
    if setting == "auto":
        return SHORT_SYSTEM_PROMPT if bundled else SYSTEM_PROMPT
    if setting == "paper":
        return SYSTEM_PROMPT
    if setting == "short":
        return SHORT_SYSTEM_PROMPT
    return setting


_BOXED = re.compile(r"\\boxed\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None


def render_prompt(question: str, system: str = SYSTEM_PROMPT) -> str:
    """Prompt text for the bundled model's chat frame (ends where the assistant starts generating)."""
    return f"{BOS}{SYSTEM}{system}{USER}{question}{ASSISTANT}"


def uses_chat_template(tokenizer) -> bool:
    """A real checkpoint's tokenizer: it brings a chat template and not the bundled model's frame tokens."""
    return bool(getattr(tokenizer, "chat_template", None)) and ASSISTANT not in tokenizer.get_vocab()


def question_frame(tokenizer) -> tuple[str, str]:
    """The text just before and just after the user's question in a rendered prompt (system prompt, then the
    question): how a reader of the prompt text (the scripted expert) finds the question under any chat template."""
    if not uses_chat_template(tokenizer):
        return USER, ASSISTANT
    system, question = "\x01system\x01", "\x02question\x02"  # marks no template writes itself
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=False,
    )
    _, found_system, rest = text.partition(system)
    before, found_question, after = rest.partition(question)
    if not (found_system and found_question):
        raise ModelLoadError(
            f"the tokenizer's chat template does not render a system message followed by the user's message "
            f"(it gave {text!r}); the agent loop's prompts need both"
        )
    return before, after


def render_conversation(messages, system: str = SYSTEM_PROMPT) -> str:
    """A multi-turn chat in the bundled model's frame: user turns after ``<|user|>``, earlier assistant turns
    closed by ``<|eos|>``; ends where the assistant starts generating."""
    parts = [BOS, SYSTEM, system]
    for m in messages:
        if m["role"] == "user":
            parts += [USER, m["content"]]
        elif m["role"] == "assistant":
            parts += [ASSISTANT, m["content"], EOS]
        else:
            raise ValueError(
                f"message role {m['role']!r}: only a leading system message, user and assistant are supported"
            )
    return "".join(parts + [ASSISTANT])
