"""What the agent loop needs of the world outside the policy: tools to call and a scorer for finished
answers. The loop receives an ``Environment`` (rapo_ray.envs.tools.ToolSet is the one every run builds)
and never imports the tools or the reward rules themselves, so a new environment needs no loop change."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass
class ToolResult:
    text: str
    ok: bool
    elapsed_s: float = 0.0


class Environment(Protocol):
    def submit(self, tool: str, content: str) -> Future:
        """Start one tool call; the future resolves to its ``ToolResult``."""

    def call_many(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        """Run (tool, content) calls concurrently; results in call order."""

    def score(self, generated_text: str, answers, kind: str, tool_bonus: float):
        """The reward of a finished trajectory's generated text: an object with ``reward``, ``correct``,
        ``f1``, ``format_ok`` and ``answer``."""

    def close(self) -> None: ...
