"""Shared command-line handling for the jobs: --config FILE, dotted overrides, --help with every field."""

from __future__ import annotations

import argparse
import sys

from rapo_ray.config import Config, ConfigError, help_text, load_config


def parse(description: str, argv=None, extra=None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides: section.key=value (e.g. algo.name=grpo rollout.num_workers=4).\n\nConfig fields:" + help_text(),
    )
    parser.add_argument("--config", default=None, help="YAML config file (fields below); overrides apply on top")
    if extra:
        extra(parser)
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    return cfg, args
