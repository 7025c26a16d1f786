"""Command-line handling shared by the jobs (--config FILE, dotted overrides, --help with every field), and the
``rapo-train`` entry point (the same as ``python jobs/train.py``)."""

from __future__ import annotations

import argparse
import sys

import psutil

from rapo_ray.config import Config, help_text, load_config
from rapo_ray.core.errors import ConfigError


def parse(description: str, argv=None, extra=None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Overrides: section.key=value (e.g. algo.name=grpo rollout.num_workers=4).\n\nConfig fields:"
        + help_text(),
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


TRAIN_USAGE = """Train an agent with RAPO (default), GRPO or ARPO.

    python jobs/train.py [--config FILE] [--dry-run] [section.key=value ...]
    rapo-train [--config FILE] [--dry-run] [section.key=value ...]
    ray job submit --working-dir . -- python jobs/train.py [...]
"""


def train_main(argv=None) -> int:
    cfg, args = parse(
        TRAIN_USAGE,
        argv,
        extra=lambda p: p.add_argument(
            "--dry-run",
            action="store_true",
            help="resolve the config, print the resource plan and exit (no Ray, no model)",
        ),
    )
    if args.dry_run:
        from rapo_ray.launch.plan import resource_plan

        print(resource_plan(cfg))
        return 0
    from rapo_ray.launch.launcher import run

    try:
        run(cfg, process_started_at=psutil.Process().create_time())  # (its imports count into the start-up)
    except ConfigError as exc:  # bad input found after parsing (a run folder, a resume, the cluster's resources)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
