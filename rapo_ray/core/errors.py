"""Every error that crosses a layer, in one place at the bottom.

A module raises these and a module of any layer catches them, so catching one never makes an import point up.
Each message names the input (a key, a path, a file and row) and what is wrong with it.
"""

from __future__ import annotations

try:  # Ray is not needed to load a model, generate or run the learner's compute (a bare GPU box has none)
    import ray.exceptions as ray_exceptions
except ImportError:
    ray_exceptions = None


def brief(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``: one log line for an error whose message (a Ray traceback) may run
    to many lines."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def require_filled(owner, names, stages: str) -> None:
    """Raise if fields ``names`` of batch ``owner`` are still None: a stage that must have run has not (one called
    out of order); ``stages`` says which stage fills what."""
    missing = [n for n in names if getattr(owner, n) is None]
    if missing:
        raise ValueError(f"{type(owner).__name__}: {missing} not filled yet ({stages})")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key or file."""


class CheckpointError(ConfigError):
    """A resume that cannot go on: the message names the path and what is wrong."""


class DeviceError(RuntimeError):
    """A component asked for a device (a GPU) that this process cannot see."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer folder is missing or unreadable; the message names the path."""


class DataError(ValueError):
    """A data file or row that cannot be read; the message names file, row and field."""


class SandboxUnavailable(RuntimeError):
    """The machine cannot give a call the isolation asked for; the message says what is missing."""


class StoreError(RuntimeError):
    """Milvus unreachable, or a collection that does not match what the caller expects."""


class RetrievalFailed(RuntimeError):
    """The retrieval service did not answer (a replica died, a timeout). The loop gives the slot a policy step
    instead and counts it (``Trajectory.retrieval_errors``): a rollout never fails for a retrieval."""


class LearnerLost(RuntimeError):
    """A learner actor died (its node went away): the step cannot finish; rebuild from the last checkpoint.
    ``in_weight_push``: it died while the rollout workers were in a weight-sync exchange with it (forming the group,
    or receiving), so they may be blocked on it until ``sync.timeout_s``: the fleet is then rebuilt too."""

    def __init__(self, message: str, in_weight_push: bool = False):
        super().__init__(message)
        self.in_weight_push = in_weight_push


# What a call to a dead (killed, crashed, node lost) Ray actor raises. An actor that Ray's memory monitor killed
# fails its pending calls with OutOfMemoryError, which is no RayActorError: without it here, a rollout worker killed
# for memory during a weight push surfaced as the learners' "connection closed" error and ended the run.
# Without Ray no actor can die, and the tuple is empty (``except ()`` catches nothing).
WORKER_DIED = (
    (
        ray_exceptions.RayActorError,
        ray_exceptions.ActorDiedError,
        ray_exceptions.WorkerCrashedError,
        ray_exceptions.OutOfMemoryError,
    )
    if ray_exceptions is not None
    else ()
)
