"""``--help``: every field with its type, default, choices and help text, section by section."""

from __future__ import annotations

import dataclasses
import typing

from rapo_ray.config.load import type_name
from rapo_ray.config.root import Config


def help_text(cfg: Config | None = None) -> str:
    """Every field with its type, default and help, grouped by section (nested sections indented)."""
    cfg = cfg or Config()
    lines: list[str] = []

    def section(obj, prefix: str, depth: int) -> None:
        pad = "  " * depth
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                lines.append(f"\n{pad}{prefix}{f.name}: {f.metadata.get('help', '')}")
                section(value, f"{prefix}{f.name}.", depth + 1)
                continue
            choices = f.metadata.get("choices")
            extra = f" {{{', '.join(map(str, choices))}}}" if choices else ""
            lines.append(f"{pad}{prefix}{f.name} ({type_name(hints[f.name])}, default {value!r}){extra}")
            lines.append(f"{pad}    {f.metadata.get('help', '')}")

    section(cfg, "", 0)
    return "\n".join(lines)
