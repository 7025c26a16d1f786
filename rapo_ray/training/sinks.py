"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard (on by default), Weights & Biases and MLflow
(off by default; ``run.wandb=true``, ``run.mlflow=true``).

A sink that fails while the run is going (a tracking server down, a full disk) is reported once and turned off:
``metrics.jsonl`` is the run's record and training does not stop for a dashboard. Failing to start one is an
error, before any training. A resumed run continues the same W&B / MLflow run: the ids live in the run folder.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from rapo_ray.config import Config, to_dict


class MetricSink(Protocol):
    name: str

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def numeric(metrics: dict) -> dict[str, float]:
    """The entries a scalar sink can take: ints, floats and bools, as floats (strings and lists dropped)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_path: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_path / "tb"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per run folder (its id in ``<run>/wandb_run_id``), written under ``<run>/wandb``; in the
    default offline mode nothing leaves the machine until ``wandb sync <run>/wandb/offline-run-*``."""

    name = "wandb"

    def __init__(self, run_path: Path, cfg: Config):
        import wandb

        id_file = run_path / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        self.run = wandb.init(
            project=cfg.run.wandb_project,
            entity=cfg.run.wandb_entity or None,
            name=run_path.name,
            id=run_id,
            resume="allow",
            dir=str(run_path),
            mode=cfg.run.wandb_mode,
            config=to_dict(cfg),
            settings=wandb.Settings(
                silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True
            ),
        )
        id_file.write_text(run_id + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # After a resume, the steps run again since the checkpoint are below W&B's last step and W&B drops them
        # (metrics.jsonl keeps both).
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """One MLflow run per run folder (its id in ``<run>/mlflow_run_id``) in ``run.mlflow_experiment``; the config
    goes in as parameters (``section.key``) when the run is created."""

    name = "mlflow"

    def __init__(self, run_path: Path, cfg: Config):
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # table creation and migrations log at INFO on first use
            logging.getLogger(noisy).setLevel(logging.WARNING)
        uri = cfg.run.mlflow_tracking_uri or f"sqlite:///{(run_path / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_path / "mlflow_run_id"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(cfg.run.mlflow_experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.run.mlflow_experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_path.name).info.run_id
            self._log_params(cfg)
            id_file.write_text(self.run_id + "\n")

    def _log_params(self, cfg: Config) -> None:
        from mlflow.entities import Param

        flat = {}
        for section, fields in asdict(cfg).items():
            for key, value in _flatten(fields, section):
                flat[key] = str(value)[:6000]  # MLflow's limit on a parameter value
        params = [Param(k, v) for k, v in sorted(flat.items())]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(entries), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=entries[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(value, prefix: str):
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}")
    else:
        yield prefix, value


def make_sinks(run_path: Path, cfg: Config) -> list[MetricSink]:
    """The sinks ``cfg.run`` asks for, started (an error here names the sink and stops the run)."""
    sinks: list[MetricSink] = []
    wanted = [
        (cfg.run.tensorboard, TensorBoardSink, ()),
        (cfg.run.wandb, WandbSink, (cfg,)),
        (cfg.run.mlflow, MlflowSink, (cfg,)),
    ]
    try:
        for enabled, cls, args in wanted:
            if enabled:
                try:
                    sinks.append(cls(run_path, *args))
                except Exception as exc:
                    raise RuntimeError(f"could not start the {cls.name} metrics sink (run.{cls.name}): {exc}") from exc
    except Exception:
        for s in sinks:
            s.close()
        raise
    return sinks
