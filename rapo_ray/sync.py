"""Weight sync: learner rank 0 sends the weights straight to every rollout engine, bucketed and versioned.

    driver (WeightSync)          learner ranks (send_weights)             rollout workers (receive_weights)
    rendezvous store only  ->    rank 0 = sync rank 0 -- buckets --->     sync ranks 1..N, load when complete
                                 ranks > 0: take part in the FSDP gather

Nothing but the calls passes through the driver or the object store. The sync group is a process group built
directly on a ``TCPStore`` (``SyncGroup``), outside torch.distributed's default group: the learners' default group
is FSDP's (``ray.util.collective``'s gloo groups live in the default group, so a learner cannot be in one), and
its world size is fixed, while the fleet's is not. The driver hosts the store for the whole run; each membership
gets a group of its own under a key prefix, rebuilt when the fleet changes.

Wire format of one push: a header (int64 ``[version, spec bytes]``), the spec (JSON: for each bucket, its tensors'
name, shape, dtype, byte offset; left out, spec bytes 0, when it is the group's previous one), then each bucket as
one uint8 tensor. Tensors travel in the engines' dtype
(``sync.dtype``): nothing is widened to fp32 on the way, and a worker loads nothing until every bucket arrived.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import uuid
from dataclasses import dataclass

import ray
import torch

_ALIGN = 64  # byte offset alignment inside a bucket: every dtype's view of its slice is aligned


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    offset: int  # bytes from the bucket's start
    nbytes: int


def plan_buckets(entries: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int) -> list[list[TensorSlot]]:
    """Lay ``(name, shape, dtype)`` entries out in buckets of at most ``bucket_bytes`` (a tensor larger than that
    gets a bucket of its own; a tensor never spans two), in order, each offset aligned to 64 bytes."""
    buckets: list[list[TensorSlot]] = []
    cur: list[TensorSlot] = []
    used = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        start = -(-used // _ALIGN) * _ALIGN
        if cur and start + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, start = [], 0
        cur.append(TensorSlot(name, tuple(shape), dtype, start, nbytes))
        used = start + nbytes
    if cur:
        buckets.append(cur)
    return buckets


def bucket_size(bucket: list[TensorSlot]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


def pack(tensors: list[torch.Tensor], bucket: list[TensorSlot]) -> torch.Tensor:
    """[bucket_size] uint8: ``tensors`` (already in their slot's dtype and shape) copied to their offsets."""
    out = torch.empty(bucket_size(bucket), dtype=torch.uint8)
    for t, slot in zip(tensors, bucket, strict=True):
        if str(t.dtype).replace("torch.", "") != slot.dtype or tuple(t.shape) != slot.shape:
            raise ValueError(f"{slot.name}: got {t.dtype} {tuple(t.shape)}, the plan says {slot.dtype} {slot.shape}")
        out[slot.offset : slot.offset + slot.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
    return out


def unpack(buf: torch.Tensor, bucket: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views of ``buf`` ([bucket_size] uint8) as the bucket's tensors (no copy)."""
    return {s.name: buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in bucket}


def _spec_to_json(buckets: list[list[TensorSlot]]) -> bytes:
    return json.dumps([[list(s.__dict__.values()) for s in b] for b in buckets]).encode()


def _spec_from_json(raw: bytes) -> list[list[TensorSlot]]:
    return [[TensorSlot(n, tuple(sh), dt, off, nb) for n, sh, dt, off, nb in b] for b in json.loads(raw)]


class SyncGroup:
    """One member's end of a weight-sync group: a gloo process group on the run's store, under ``name``."""

    def __init__(self, host: str, port: int, name: str, rank: int, world: int, timeout_s: float):
        """``host``: the store's address; 127.0.0.1 means every member is on this one machine, and then the
        members' own sockets stay on loopback too."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        my_ip = host if host == "127.0.0.1" else ray.util.get_node_ip_address()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=my_ip)]
        opts._timeout = timeout
        self.name, self.rank, self.world = name, rank, world
        self.spec: bytes | None = None  # the last push's spec: a push with the same layout does not resend it
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, opts)

    def broadcast_async(self, t: torch.Tensor):
        """Start a broadcast from rank 0; the returned work's ``wait()`` ends it (and raises its error)."""
        if self.pg is None:
            raise RuntimeError(f"weight-sync group {self.name} was aborted")
        return self.pg.broadcast(t, 0)

    def broadcast(self, t: torch.Tensor) -> None:
        self.broadcast_async(t).wait()

    def abort(self) -> None:
        """Close the connections, so members waiting in a broadcast fail now instead of at the timeout. Only the
        process group's destructor closes them (measured: ``abort()`` and ``shutdown()`` leave the peers waiting)."""
        pg, self.pg = self.pg, None
        del pg


def send_state(
    group: SyncGroup | None, version: int, entries: list[tuple[str, tuple, str]], fetch, bucket_bytes: int
) -> dict:
    """Send ``version`` of the weights over ``group`` (sync rank 0), bucket by bucket.

    ``entries``: (name, shape, dtype) in send order; ``fetch(bucket)`` returns the bucket's tensors packed (``pack``)
    on the sending rank, anything elsewhere. Every learner rank calls this with the same entries, since ``fetch``
    may be a collective (one FSDP gather per bucket);
    only the rank holding ``group`` sends. A failed send aborts the group (no receiver waits for the rest) and is
    raised after the last gather, so the other learner ranks are never left waiting in one; any other error aborts
    the group and is raised at once. A bucket's broadcast runs while the next one is gathered; ``fetch`` may reuse a
    buffer every other call. Returns bytes sent, seconds gathering, and seconds waiting for sends to finish."""
    buckets = plan_buckets(entries, bucket_bytes)
    gather_s = send_s = 0.0
    failure: BaseException | None = None
    inflight: list = []  # (work, tensor) of the bucket being broadcast while the next one is gathered

    def finish() -> None:
        nonlocal failure, send_s
        if not inflight:
            return
        t0 = time.perf_counter()
        work, _ = inflight.pop()
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - raised after the gathers below
            failure = exc
            del work  # (it holds the process group: abort() must drop the last reference)
            group.abort()
        send_s += time.perf_counter() - t0

    def send(t: torch.Tensor, overlap: bool = False) -> None:
        nonlocal failure
        if group is None or failure is not None:
            return
        finish()  # one broadcast in flight at a time: the gather's two bucket buffers alternate
        if failure is not None:
            return
        try:
            inflight.append((group.broadcast_async(t), t))
        except Exception as exc:  # noqa: BLE001 - raised after the gathers below
            failure = exc
            group.abort()
            return
        if not overlap:
            finish()

    try:
        spec = _spec_to_json(buckets)
        fresh = group is not None and spec != group.spec
        send(torch.tensor([version, len(spec) if fresh else 0], dtype=torch.int64))
        if fresh:
            send(torch.frombuffer(bytearray(spec), dtype=torch.uint8))
            group.spec = spec
        for bucket in buckets:
            t0 = time.perf_counter()
            packed = fetch(bucket)  # even after a failed send: the other ranks wait in this gather
            gather_s += time.perf_counter() - t0
            send(packed, overlap=True)
        finish()
    except BaseException:  # a failed gather or pack: the receivers must not wait for the rest
        inflight.clear()
        if group is not None:
            group.abort()
        raise
    if failure is not None:
        raise failure
    return {
        "bytes": sum(bucket_size(b) for b in buckets),
        "buckets": len(buckets),
        "gather_s": gather_s,
        "send_s": send_s,
    }


def receive_state(group: SyncGroup) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one push (``send_state``) on a non-zero rank: the version and the full state dict, in the dtype sent.
    On an error the group is aborted and nothing is returned, so a partial push is never loaded."""
    try:
        header = torch.zeros(2, dtype=torch.int64)
        group.broadcast(header)
        version = int(header[0])
        if header[1]:
            raw = torch.empty(int(header[1]), dtype=torch.uint8)
            group.broadcast(raw)
            group.spec = raw.numpy().tobytes()
        if group.spec is None:
            raise RuntimeError(f"weight push {version}: no layout received in group {group.name}")
        buckets = _spec_from_json(group.spec)
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            buf = torch.empty(bucket_size(bucket), dtype=torch.uint8)
            group.broadcast(buf)
            out.update(unpack(buf, bucket))
    except BaseException:
        group.abort()
        raise
    return version, out


# ---------------------------------------------------------------- the driver's side


class WeightSync:
    """Driver side: hosts the rendezvous store, (re)forms the group for the current fleet, and starts each push
    on the learner ranks (senders) and the rollout workers (receivers) at once.

    The learner actors need ``join_weight_sync(host, port, name, world, timeout_s)`` (rank 0 only) and
    ``send_weights(version, bucket_bytes, dtype)`` (every rank); the workers ``join_weight_sync(host, port, name,
    rank, world, timeout_s)`` and ``receive_weights()``."""

    def __init__(self, bucket_mb: float = 32.0, timeout_s: float = 600.0, dtype: str = "float32"):
        import torch.distributed as dist

        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.timeout_s, self.dtype = timeout_s, dtype
        # port 0: the OS picks a free one; the store listens on every interface as long as this object lives
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.prefix = f"rapo_weights_{uuid.uuid4().hex[:8]}"
        self.generation = 0
        self.members: tuple = ()
        self.last_ms = 0.0
        self.last: dict = {}

    def reset(self) -> None:
        """After a failed push: the group is formed afresh at the next push."""
        self.members = ()

    def _ensure_group(self, sender, workers: list) -> None:
        key = (sender._actor_id.hex(),) + tuple(w._actor_id.hex() for w in workers)
        if key == self.members:
            return
        self.generation += 1
        name, world = f"{self.prefix}_{self.generation}/", len(workers) + 1
        one_machine = sum(n["Alive"] for n in ray.nodes()) == 1  # (a local Ray): loopback only
        host = "127.0.0.1" if one_machine else ray.util.get_node_ip_address()
        args = (host, self.store.port, name)
        self._wait(
            [sender.join_weight_sync.remote(*args, world, self.timeout_s)]
            + [w.join_weight_sync.remote(*args, i + 1, world, self.timeout_s) for i, w in enumerate(workers)],
            "forming the group",
        )
        self.members = key

    def push(self, learners: list, workers: list, version: int) -> float:
        """Send the learners' current weights to ``workers`` as ``version``; returns the milliseconds it took.
        ``learners``: every learner rank's actor, rank 0 first (each takes part in the gather)."""
        t0 = time.perf_counter()
        try:
            self._ensure_group(learners[0], workers)
            sends = [r.send_weights.remote(version, self.bucket_bytes, self.dtype) for r in learners]
            recvs = [w.receive_weights.remote() for w in workers]
            results = self._wait(sends + recvs, "broadcasting", n_learners=len(sends))
        except BaseException:
            self.members = ()  # the members dropped their ends of the group
            raise
        got = results[len(sends) :]
        if got != [version] * len(workers):
            raise RuntimeError(f"weight push {version}: the workers report versions {got}")
        self.last_ms = (time.perf_counter() - t0) * 1000
        self.last = {**results[0], "ms": self.last_ms}
        return self.last_ms

    def _wait(self, refs: list, what: str, n_learners: int = 1) -> list:
        """Every result, or one error: a lost learner first (the step cannot finish), then a dead rollout worker
        (the caller can replace it and push again; the senders fail after it, since the group aborts), then the
        first other error."""
        from rapo_ray.learner import LearnerLost
        from rapo_ray.rollout import WORKER_DIED

        t0 = time.monotonic()
        try:
            return ray.get(refs, timeout=self.timeout_s)  # the usual case: one call
        except ray.exceptions.GetTimeoutError:
            pending = refs
        except Exception:  # noqa: BLE001 - which member failed decides what to raise: look at each
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, self.timeout_s - time.monotonic() + t0))
        if pending:
            raise TimeoutError(
                f"weight push: {what} took more than {self.timeout_s:.0f} s (sync.timeout_s); a learner or rollout "
                "worker is stuck"
            )
        results, errors = [], []
        for i, r in enumerate(refs):
            try:
                results.append(ray.get(r))
            except Exception as exc:  # noqa: BLE001 - ranked below
                errors.append((i, exc))
        for i, exc in errors:
            if i < n_learners and isinstance(exc, WORKER_DIED):
                raise LearnerLost(f"a learner died during the weight push ({what}): {exc}") from exc
        for _, exc in errors:
            if isinstance(exc, WORKER_DIED):
                raise exc
        if errors:
            raise errors[0][1]
        return results

    def close(self) -> None:
        self.store = None
