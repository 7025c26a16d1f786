"""The OpenAI chat-completions wire format: request validation and response / stream-chunk shaping.

The agent's reply is the content of its ``<answer>`` block; the whole tool loop (think, python, search,
tool results) goes into ``reasoning_content`` (the field vLLM and DeepSeek use for reasoning text), and the
structured trace into ``tool_trace``, so plain OpenAI clients see a normal answer and agent-aware clients
see everything. Validation errors name the field and what is wrong; the app turns them into HTTP 400.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from rapo_ray.agent.loop import AgentLoop
from rapo_ray.types import protocol
from rapo_ray.types.trajectory import GENERATED, RETRIEVED, TOOL_RESULT

ROLES = ("system", "user", "assistant")
_ANSWER = re.compile(re.escape(protocol.ANSWER[0]) + r"(.*?)" + re.escape(protocol.ANSWER[1]), re.S)
_SUPPORTED_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "seed",
    "max_tool_calls",
}
# Bookkeeping fields that do not change the reply: accepted and not used.
_IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# OpenAI fields this server does not implement: a request that sets one to anything but its default gets a 400
# naming it, rather than a reply that silently ignores it.
_UNSUPPORTED_FIELDS = {
    "stop": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "logprobs": False,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "reasoning_effort": None,
    "modalities": None,
}


class BadRequest(ValueError):
    """A client error: HTTP 400 with this message."""


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    max_tool_calls: int = 3
    model: str = ""
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{key}' must be a number, got {type(v).__name__}")
    if not (lo <= v <= hi):
        raise BadRequest(f"'{key}' must be in [{lo:g}, {hi:g}], got {v}")
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {type(v).__name__}")
    if not (lo <= v <= hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {v}")
    return v


def _unicode(text: str, where: str) -> str:
    """``text`` if it is valid Unicode. JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer
    can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"{where} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None
    return text


def _content_text(content, where: str) -> str:
    """String content, or the OpenAI list-of-parts form with text parts only."""
    if isinstance(content, str):
        return _unicode(content, f"{where}.content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': str}}) are supported"
                )
            texts.append(_unicode(part["text"], f"{where}.content[{j}].text"))
        return "".join(texts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def parse_chat_request(body, serve_cfg, model_name: str) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body against the server's limits (``ServeConfig``)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _SUPPORTED_FIELDS - _IGNORED_FIELDS - set(_UNSUPPORTED_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    for key, default in _UNSUPPORTED_FIELDS.items():
        if body.get(key, default) not in (default, None, [], {}):
            raise BadRequest(
                f"'{key}' is not supported by this server (the agent's tools, stops and sampling are fixed)"
            )
    msgs = body.get("messages")
    if msgs is None:
        raise BadRequest("'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    messages, total = [], 0
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        if role == "system" and i != 0:
            raise BadRequest(f"{where}: a system message is only allowed first")
        text = _content_text(m.get("content"), where)
        total += len(text)
        messages.append({"role": role, "content": text})
    if messages[-1]["role"] != "user":
        raise BadRequest(f"the last message must be from the user, got {messages[-1]['role']!r}")
    if total > serve_cfg.max_request_chars:
        raise BadRequest(f"'messages' hold {total} characters; the limit is {serve_cfg.max_request_chars}")
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {type(model).__name__}")
    if model and model != model_name:
        raise BadRequest(f"unknown model {model!r}; this server serves {model_name!r}")
    if body.get("n", 1) not in (1, None):
        raise BadRequest("'n' must be 1 (one agent run per request)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {type(stream).__name__}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, 1, serve_cfg.max_tokens, serve_cfg.default_max_tokens)
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 1e-6, 1.0, 1.0),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1, None),
        max_tool_calls=_integer(body, "max_tool_calls", 0, serve_cfg.max_tool_calls, serve_cfg.max_tool_calls),
        model=model_name,
    )


# ---------------------------------------------------------------- responses

FINISH_REASON = {"answer": "stop", "eos": "stop", "empty": "stop", "length": "length", "tool_limit": "length"}


def segment_texts(tokenizer, traj) -> list[tuple[str, str]]:
    """(kind, text) of every segment of a trajectory, in order."""
    return [
        (kind, tokenizer.decode(traj.response_ids[s:e].tolist(), skip_special_tokens=False))
        for kind, s, e in traj.segments
    ]


def answer_of(generated: str) -> str:
    """The content of the last ``<answer>`` block; without one, the generated text minus protocol tags."""
    found = _ANSWER.findall(generated)
    if found:
        return found[-1].strip()
    text = generated
    for tag in protocol.ALL_TAGS + protocol.FRAME_TOKENS:
        text = text.replace(tag, "")
    return text.strip()


def tool_trace(segments: list[tuple[str, str]]) -> list[dict]:
    """Each tool call with its input and output: a generated step ending in a tool tag, then its result."""
    trace = []
    for (kind, text), nxt in zip(segments, segments[1:] + [("", "")]):
        if kind != GENERATED:
            continue
        for tool, close in (("python", protocol.PYTHON[1]), ("search", protocol.SEARCH[1])):
            if text.endswith(close):
                call = AgentLoop._parse_call(text, tool)
                output = nxt[1] if nxt[0] == TOOL_RESULT else ""
                output = output.removeprefix(protocol.RESULT[0]).removesuffix(protocol.RESULT[1])
                trace.append({"tool": tool, "input": call.replace("\x00error:", "malformed call: "), "output": output})
    return trace


def reasoning_text(segments: list[tuple[str, str]]) -> str:
    return "".join(text for kind, text in segments if kind in (GENERATED, TOOL_RESULT, RETRIEVED))


def completion_response(req: ChatRequest, tokenizer, traj) -> dict:
    segs = segment_texts(tokenizer, traj)
    generated = "".join(t for k, t in segs if k == GENERATED)
    return {
        "id": req.id,
        "object": "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": answer_of(generated),
                    "reasoning_content": reasoning_text(segs),
                    "tool_trace": tool_trace(segs),
                },
                "finish_reason": FINISH_REASON.get(traj.finish_reason, "stop"),
            }
        ],
        "usage": usage(traj),
        "agent": {
            "finish_reason": traj.finish_reason,
            "tool_calls": traj.tool_calls,
            "tool_errors": traj.tool_errors,
            "policy_version": traj.policy_version,
        },
    }


def usage(traj) -> dict:
    gen = traj.num_generated_tokens
    return {
        "prompt_tokens": len(traj.prompt_ids),
        "completion_tokens": gen,
        "total_tokens": len(traj.prompt_ids) + gen,
        "tool_result_tokens": traj.num_tool_tokens,
    }


def chunk(req: ChatRequest, delta: dict, finish_reason: str | None = None, extra: dict | None = None) -> dict:
    out = {
        "id": req.id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    if extra:
        out.update(extra)
    return out
