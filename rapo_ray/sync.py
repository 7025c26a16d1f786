"""Weight sync: learner -> every rollout engine through ``ray.util.collective``, bucketed, versioned.

The learner ranks own torch.distributed's default process group (FSDP). ``ray.util.collective``'s gloo
backend also builds on torch.distributed, and creating its group inside a learner that already owns an
FSDP default group fails (measured: "collective group not initialized"). So rank 0 hands the gathered
full state dict to a ``WeightHub`` actor (one object-store hop), and the hub is rank 0 of the collective
group whose other members are the rollout workers. The group is rebuilt whenever the fleet's membership
changes.
"""

from __future__ import annotations

import math
import time
import uuid

import ray
import torch


def make_buckets(state_dict: dict, bucket_mb: float) -> tuple[list[tuple[str, list[int], str]], list[torch.Tensor]]:
    """Flatten tensors into float32 buckets of at most ``bucket_mb`` MiB (a tensor never spans two)."""
    limit = max(1, int(bucket_mb * (1 << 20) / 4))
    spec, buckets, cur, size = [], [], [], 0
    for name, t in state_dict.items():
        spec.append((name, list(t.shape), str(t.dtype).replace("torch.", "")))
        flat = t.detach().reshape(-1).to(torch.float32)
        if cur and size + flat.numel() > limit:
            buckets.append(torch.cat(cur))
            cur, size = [], 0
        cur.append(flat)
        size += flat.numel()
    if cur:
        buckets.append(torch.cat(cur))
    return spec, buckets


def join_group(world: int, rank: int, name: str, previous: str | None) -> None:
    """(Re)join the weight-sync group. ray.util.collective's gloo backend sits on torch.distributed's
    default group, whose world size cannot grow, so it is torn down before a new membership is formed."""
    import ray.util.collective as col
    import torch.distributed as dist

    if previous:
        col.destroy_collective_group(previous)
    if dist.is_initialized():
        dist.destroy_process_group()
    col.init_collective_group(world, rank, backend="gloo", group_name=name)


def receive_buckets(spec, bucket_numels: list[int], group_name: str) -> dict:
    import ray.util.collective as col

    buckets = []
    for n in bucket_numels:
        buf = torch.empty(n, dtype=torch.float32)
        col.broadcast(buf, src_rank=0, group_name=group_name)
        buckets.append(buf)
    flat = torch.cat(buckets) if len(buckets) > 1 else buckets[0]
    out, off = {}, 0
    for name, shape, dtype in spec:
        n = math.prod(shape) if shape else 1
        out[name] = flat[off : off + n].view(shape).to(getattr(torch, dtype))
        off += n
    return out


@ray.remote(num_cpus=0)
class WeightHub:
    """Rank 0 of the weight-sync collective group."""

    def __init__(self):
        torch.set_num_threads(1)
        self.group: str | None = None
        self.spec, self.buckets = None, None

    def join(self, world: int, name: str) -> bool:
        join_group(world, 0, name, self.group)
        self.group = name
        return True

    def stage(self, state_dict: dict, bucket_mb: float) -> tuple[list, list[int]]:
        self.spec, self.buckets = make_buckets(state_dict, bucket_mb)
        return self.spec, [b.numel() for b in self.buckets]

    def broadcast(self) -> float:
        import ray.util.collective as col

        t0 = time.perf_counter()
        for b in self.buckets:
            col.broadcast(b, src_rank=0, group_name=self.group)
        return time.perf_counter() - t0


class WeightSync:
    """Driver-side helper: (re)builds the group for the current fleet and pushes a versioned state dict."""

    def __init__(self, bucket_mb: float = 32.0, timeout_s: float = 600.0):
        self.bucket_mb, self.timeout_s = bucket_mb, timeout_s
        self.generation = 0
        self.prefix = f"rapo_weights_{uuid.uuid4().hex[:8]}"  # unique per run: no stale rendezvous state
        self.last_ms = 0.0
        self.hub = self._new_hub()
        self.members: tuple = ()

    @staticmethod
    def _new_hub():
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # on the driver's node (the head under `ray job submit`): anywhere else, losing that node would take the
        # hub down mid-push, which the cluster simulation's learner-node loss did (ActorDiedError: WeightHub)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return WeightHub.options(scheduling_strategy=here).remote()

    def reset(self) -> None:
        """After a failed push: a new hub (the old one may sit in a broadcast with a dead member), and the group
        is rebuilt at the next push."""
        ray.kill(self.hub)
        self.hub = self._new_hub()
        self.members = ()

    def _ensure_group(self, workers: list) -> str:
        key = tuple(w._actor_id.hex() for w in workers)
        name = f"{self.prefix}_{self.generation}"
        if key != self.members:
            self.generation += 1
            name = f"{self.prefix}_{self.generation}"
            world = len(workers) + 1
            self._get(
                [self.hub.join.remote(world, name)]
                + [w.join_collective.remote(world, i + 1, name) for i, w in enumerate(workers)],
                "forming the group",
            )
            self.members = key
        return name

    def push(self, state_dict: dict, version: int, workers: list) -> float:
        t0 = time.perf_counter()
        name = self._ensure_group(workers)
        spec, numels = self._get(self.hub.stage.remote(state_dict, self.bucket_mb), "staging")
        recv = [w.receive_broadcast.remote(spec, numels, version, name) for w in workers]
        self._get([self.hub.broadcast.remote()] + recv, "broadcasting")
        self.last_ms = (time.perf_counter() - t0) * 1000
        return self.last_ms

    def _get(self, refs, what: str):
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"weight push: {what} took more than {self.timeout_s:.0f} s (sync.timeout_s); a rollout worker or the "
                "weight hub is stuck"
            ) from None
