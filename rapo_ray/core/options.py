"""The building blocks of a config section: ``option`` (a field with its help text and choices) and ``require``.

They sit in ``core`` so that an algorithm can declare its own section beside its code (``rapo_ray/algos/rapo.py``'s
``RapoConfig``) while ``rapo_ray/config`` reads every section the same way.
"""

from __future__ import annotations

from dataclasses import field

from rapo_ray.core.errors import ConfigError


def option(default, help: str, choices: tuple | None = None, aliases: dict | None = None):
    """A config field: its default, its help text and (optionally) the values it may take, and older names of
    those values that saved run configs may still carry (``aliases``: old -> current)."""
    meta = {"help": help, "choices": choices, "aliases": aliases or {}}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``; the message names the field."""
    if not ok:
        raise ConfigError(message)
