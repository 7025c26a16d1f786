"""Loading a configuration: defaults <- YAML file <- dotted overrides, type-checked, then validated.

Unknown keys and wrong types raise ``ConfigError`` naming the key and listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rapo_ray.config.root import Config
from rapo_ray.core.errors import ConfigError

_NONE = type(None)


def type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and _NONE in args:
            return None
        for arg in args:
            if arg is _NONE:
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {tp}, got {value!r}")
    base = origin or tp
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif base is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, str):  # "a,b" from the command line
            return [v for v in value.split(",") if v]
    elif base is dict:
        if isinstance(value, dict):
            return dict(value)
    else:
        return value
    raise ConfigError(f"{key}: expected {type_name(base)}, got {type(value).__name__} {value!r}")


def _apply(obj, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(
                f"unknown config key {full!r}; valid keys under {prefix.rstrip('.') or 'top level'}: {sorted(fields)}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, full + ".")
            continue
        new = _coerce(value, hints[key], full)
        new = fields[key].metadata.get("aliases", {}).get(new, new) if isinstance(new, str) else new
        choices = fields[key].metadata.get("choices")
        if choices and new not in choices:
            raise ConfigError(f"{full}: {new!r} is not one of {list(choices)}")
        setattr(obj, key, new)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from None
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides, then ``validate()``."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
        try:
            _apply(cfg, data)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, nested)
    cfg.model.apply_size()
    return cfg.validate()


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def flat_config(data: dict, prefix: str = "") -> dict:
    """``to_dict``'s nested sections as one level of dotted keys (``algo.rapo.n_hybrid``); resource maps stay whole."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and not k.endswith("custom_resources"):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff_configs(a: Config, b: Config, ignore: tuple = ()) -> list[str]:
    """Dotted keys whose values differ (used to refuse an incompatible resume)."""
    fa, fb = flat_config(to_dict(a)), flat_config(to_dict(b))
    return sorted(k for k in fa if fa[k] != fb.get(k) and not any(k.startswith(i) for i in ignore))
