"""Weight sync: every learner rank sends its own shard of the weights straight to every rollout engine, bucketed
and versioned.

    driver (WeightSync)          learner ranks (send_weights)                   rollout workers (receive_weights)
    rendezvous store only  ->    sync rank r = learner rank r: its FSDP    ->   sync ranks L..L+N-1: put each bucket's
                                 rows of each bucket, point to point            rows together, load when complete

Nothing but the calls passes through the driver or the object store, and nothing is copied between the learners:
FSDP2 holds rows [r*c, min((r+1)*c, d0)) of every parameter on rank r (``shard_rows``), so rank r sends exactly
those rows of every bucket to every worker, and the worker writes them to their place in the bucket. The engines
receive each byte of the model once, and no learner waits on a gather.

The sync group is a process group built directly on a ``TCPStore`` (``SyncGroup``), outside torch.distributed's
default group: the learners' default group is FSDP's (``ray.util.collective``'s gloo groups live in the default
group, so a learner cannot be in one), and its world size is fixed, while the fleet's is not. The driver hosts the
store for the whole run; each membership gets a group of its own under a key prefix, rebuilt when the fleet changes.

Wire format of one push: a header broadcast from sync rank 0 (int64 ``[version, spec bytes, senders]``), the spec
(JSON: for each bucket, its tensors' name, shape, dtype, byte offset, size and rows per sender; left out, spec
bytes 0, when it is the group's previous one), then for each bucket and each sender holding rows of it one uint8
segment (``segment``), sent point to point to each worker with the bucket's index as tag. Tensors travel in the
engines' dtype (``sync.dtype``): nothing is widened to fp32 on the way, and a worker loads nothing until every
bucket arrived.
"""

from __future__ import annotations

import datetime
import glob
import os
import time
import uuid

import ray
import torch

from rapo_ray.core.errors import WORKER_DIED, LearnerLost
from rapo_ray.workers.colocated import shared_dir
from rapo_ray.workers.weight_layout import (
    Piece,
    ReusedBuffers,
    TensorSlot,
    aligned,
    bucket_size,
    is_whole,
    message_size,
    pack_segment,
    place,
    plan_buckets,
    segment,
    spec_from_json,
    spec_to_json,
    unpack,
)

DIRECT_BYTES = 1 << 20  # a piece this large travels as its own message, received straight into its place
_TAGS_PER_BUCKET = 1 << 16  # message k of bucket b has tag b * _TAGS_PER_BUCKET + k


def messages(bucket: list[TensorSlot], sender: int, direct_bytes: int) -> list[list[Piece]]:
    """How ``sender``'s rows of ``bucket`` travel, one list of pieces per message, in order (message k has tag
    ``bucket index * _TAGS_PER_BUCKET + k``); each piece's offset is within its message.

    A sender holding the whole bucket sends it as one message in the bucket's layout (received in place).
    Otherwise pieces under ``direct_bytes`` go together in one message (the worker copies them into place), and
    each larger piece is a message of its own, received straight into its place in the bucket: at large shapes,
    copying every row through a staging buffer was a fifth of a push (docs/RESULTS.md, Performance)."""
    pieces = segment(bucket, sender)
    if not pieces:
        return []
    if is_whole(pieces, bucket):
        return [pieces]
    small, used, out = [], 0, []
    for p in pieces:
        if p.nbytes >= direct_bytes:
            out.append([Piece(p.slot, p.first_row, p.n_rows, 0, p.nbytes)])
        else:
            start = aligned(used)
            small.append(Piece(p.slot, p.first_row, p.n_rows, start, p.nbytes))
            used = start + p.nbytes
    return ([small] if small else []) + out


def pack_message(buffers, name: str, pieces: list[Piece], local) -> torch.Tensor:
    """One message's bytes: a lone piece whose rows are already a contiguous CPU tensor in the wire dtype is sent as
    it is (no copy: an fp32 master shard on an fp32 wire); anything else is packed into ``buffers[name]``."""
    if len(pieces) == 1 and pieces[0].offset == 0:
        rows = local(pieces[0].slot.name)
        if (
            str(rows.dtype).replace("torch.", "") == pieces[0].slot.dtype
            and rows.device.type == "cpu"
            and rows.is_contiguous()
            and rows.numel() * rows.element_size() == pieces[0].nbytes
        ):
            return rows.detach().reshape(-1).view(torch.uint8)
    return pack_segment(buffers.get(name, message_size(pieces)), pieces, local)


def member_key(handle) -> str:
    """A sync member's identity: its actor's id, or the handle's own ``member_key`` where several members share
    one actor (the control-plane benchmark's packed engines)."""
    return handle._actor_id.hex() if isinstance(handle, ray.actor.ActorHandle) else handle.member_key


# Groups of at least this many members connect lazily (a pair when it first exchanges data); smaller ones connect
# every pair as they form. Eager formation makes N(N-1)/2 connections and N-1 sockets in each member, which stops
# scaling at hundreds of members, though only the learner ranks send data. But gloo's lazy connect has a failure
# path that hangs: after a peer died, a member dropping the group can spin forever in the group's destructor
# (pytorch/gloo#520), holding the GIL. Eager groups did not show it (docs/RESULTS.md, Known limits).
LAZY_CONNECT_MIN_MEMBERS = 64


class SyncGroup:
    """One member's end of a weight-sync group: a gloo process group on the run's store, under ``name``."""

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        rank: int,
        world: int,
        timeout_s: float,
        store=None,
        lazy: bool | None = None,
    ):
        """``host``: the store's address; 127.0.0.1 means every member is on this one machine, and then the
        members' own sockets stay on loopback too. ``lazy``: connect pairs at their first exchange; default, for
        groups of ``LAZY_CONNECT_MIN_MEMBERS`` or more (every member of a group must agree). ``store``: a client of
        that store to share (members packed in one process), used by a lazy group only: the concurrent rendezvous
        of an eager one over one shared client stalls until the timeout. Otherwise the member opens its own."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        lazy = world >= LAZY_CONNECT_MIN_MEMBERS if lazy is None else lazy
        if store is None or not lazy:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        my_ip = host if host == "127.0.0.1" else ray.util.get_node_ip_address()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=my_ip, lazy_init=lazy)]
        opts._timeout = timeout
        self.name, self.rank, self.world = name, rank, world
        self.spec: bytes | None = None  # the last push's spec: a push with the same layout does not resend it
        self.buffers = ReusedBuffers()  # staging segments and received buckets, kept between buckets and pushes
        self.last_receive: dict = {}  # a worker's seconds waiting for data and putting rows in place (bench_sync)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, opts)

    @classmethod
    def join(
        cls, previous: SyncGroup | None, host: str, port: int, name: str, rank: int, world: int, timeout_s, store=None
    ):
        """Leave ``previous`` (if any) and become ``rank`` of ``name``: what a learner or a worker does when the
        driver forms a new group."""
        if previous is not None:
            previous.abort()
        group = cls(host, port, name, rank, world, timeout_s, store)
        if previous is not None:
            group.buffers = previous.buffers  # (already paged in)
        return group

    def _live_pg(self):
        if self.pg is None:
            raise RuntimeError(f"weight-sync group {self.name} was aborted")
        return self.pg

    def broadcast_async(self, t: torch.Tensor):
        """Start a broadcast from rank 0; the returned work's ``wait()`` ends it (and raises its error)."""
        return self._live_pg().broadcast(t, 0)

    def broadcast(self, t: torch.Tensor) -> None:
        self.broadcast_async(t).wait()

    def send_async(self, t: torch.Tensor, dst: int, tag: int):
        return self._live_pg().send([t], dst, tag)

    def recv_async(self, t: torch.Tensor, src: int, tag: int):
        return self._live_pg().recv([t], src, tag)

    def abort(self) -> None:
        """Close the connections, so members waiting in a transfer fail now instead of at the timeout. Only the
        process group's destructor closes them (``abort()`` and ``shutdown()`` leave the peers waiting)."""
        pg, self.pg = self.pg, None
        del pg


def send_state(
    group: SyncGroup,
    version: int,
    entries: list[tuple],
    local,
    senders: int,
    bucket_bytes: int,
    direct_bytes: int = DIRECT_BYTES,
) -> dict:
    """Send this sender's rows of ``version`` of the weights (sync rank ``group.rank`` < ``senders``) to every
    worker (sync ranks ``senders``..world-1), bucket by bucket.

    ``entries``: (name, shape, dtype, rows per sender) in send order, the same on every sender; ``local(name)``:
    the rows this sender holds of that tensor. Sync rank 0 also sends the header and, when it changed, the spec.
    Each bucket goes as ``messages``; one bucket's sends run while the next is packed (staging buffers in turn). Any error aborts the group, so
    no worker waits for the rest, and is raised. Returns bytes sent (per worker), seconds in the header's broadcast
    (waiting for the other members to arrive), seconds packing, and seconds waiting for sends to finish."""
    buckets = plan_buckets(entries, bucket_bytes)
    workers = range(senders, group.world)
    pack_s = send_s = 0.0
    sent = 0
    inflight: list = []  # the works of the bucket being sent while the next one is packed

    def finish() -> None:
        nonlocal send_s
        t0 = time.perf_counter()
        while inflight:
            inflight.pop().wait()
        send_s += time.perf_counter() - t0

    try:
        spec = spec_to_json(buckets)
        fresh = spec != group.spec  # rank 0 decides; the other senders follow its header
        header = torch.tensor([version, len(spec) if fresh else 0, senders, direct_bytes], dtype=torch.int64)
        t0 = time.perf_counter()
        group.broadcast(header)  # (waits for every member to be called)
        header_s = time.perf_counter() - t0
        if header[1]:
            if group.rank == 0:
                raw = torch.frombuffer(bytearray(spec), dtype=torch.uint8)
            else:
                raw = torch.empty(int(header[1]), dtype=torch.uint8)
            group.broadcast(raw)
            group.spec = raw.numpy().tobytes()
        if group.spec != spec:
            raise RuntimeError(
                f"weight push {version}: learner rank {group.rank} lays the weights out unlike rank 0 "
                "(different parameters or shapes on the learner ranks)"
            )
        for b, bucket in enumerate(buckets):
            plan = messages(bucket, group.rank, direct_bytes)
            if not plan:
                continue
            t0 = time.perf_counter()
            group.buffers.turn ^= 1  # the other buffers may still be on the wire until finish()
            wire = [pack_message(group.buffers, f"{k}.{group.buffers.turn}", m, local) for k, m in enumerate(plan)]
            pack_s += time.perf_counter() - t0
            finish()
            for k, t in enumerate(wire):
                inflight.extend(group.send_async(t, dst, b * _TAGS_PER_BUCKET + k) for dst in workers)
                sent += t.numel()
        finish()
    except BaseException:
        inflight.clear()
        group.abort()
        raise
    return {"bytes": sent, "buckets": len(buckets), "header_s": header_s, "pack_s": pack_s, "send_s": send_s}


def receive_state(group: SyncGroup) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one push (``send_state``) on a worker: the version and the full state dict, in the dtype sent.
    On an error the group is aborted and nothing is returned, so a partial push is never loaded.

    The state dict's tensors are views of buffers that the group keeps for the next push (fresh buffers were page
    faults on every byte: see ``ReusedBuffers``), so the caller must copy them (engines' ``load_weights`` do) before
    receiving again. A worker holds one received copy of the model between pushes, as it did during one."""
    pending: list = []  # works in flight: they hold the process group, so they go before abort() closes it
    wait_s = copy_s = 0.0
    try:
        header = torch.zeros(4, dtype=torch.int64)
        group.broadcast(header)
        version, spec_bytes, senders, direct_bytes = (int(x) for x in header)
        if spec_bytes:
            raw = torch.empty(spec_bytes, dtype=torch.uint8)
            group.broadcast(raw)
            group.spec = raw.numpy().tobytes()
        if group.spec is None:
            raise RuntimeError(f"weight push {version}: no layout received in group {group.name}")
        out: dict[str, torch.Tensor] = {}
        for b, bucket in enumerate(spec_from_json(group.spec)):
            buf = group.buffers.get(f"bucket{b}", bucket_size(bucket))
            staged = []  # (pieces, staging buffer) of messages that are copied into place once received
            for r in range(senders):
                for k, pieces in enumerate(messages(bucket, r, direct_bytes)):
                    if len(pieces) == 1:  # a piece of its own (offset 0): straight into its place
                        lo, hi = place(pieces[0])
                        dst = buf[lo:hi]
                    elif is_whole(pieces, bucket):  # one sender holds the whole bucket: in place
                        dst = buf
                    else:
                        dst = group.buffers.get(f"from{r}", message_size(pieces))
                        staged.append((pieces, dst))
                    pending.append(group.recv_async(dst, r, b * _TAGS_PER_BUCKET + k))
            t0 = time.perf_counter()
            while pending:
                pending[0].wait()
                pending.pop(0)
            t1 = time.perf_counter()
            for pieces, s in staged:
                for p in pieces:
                    lo, hi = place(p)
                    buf[lo:hi].copy_(s[p.offset : p.offset + p.nbytes])
            wait_s, copy_s = wait_s + t1 - t0, copy_s + time.perf_counter() - t1
            out.update(unpack(buf, bucket))
    except BaseException:
        pending.clear()
        group.abort()
        raise
    group.last_receive = {"wait_s": wait_s, "copy_s": copy_s}
    return version, out


# ---------------------------------------------------------------- the driver's side


def gather_push(refs: list, what: str, timeout_s: float, n_learners: int = 1) -> list:
    """Every result of a push's calls (the first ``n_learners`` on learner ranks), or one error: a lost learner
    first (the step cannot finish), then a dead rollout worker (the caller can replace it and push again; the
    senders fail after it, since the group aborts), then the first other error."""
    t0 = time.monotonic()
    try:
        return ray.get(refs, timeout=timeout_s)  # the usual case: one call
    except ray.exceptions.GetTimeoutError:
        pending = refs
    except Exception:  # noqa: BLE001 - which member failed decides what to raise: look at each
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout_s - time.monotonic() + t0))
    if pending:
        raise TimeoutError(
            f"weight push: {what} took more than {timeout_s:.0f} s (sync.timeout_s); a learner or rollout "
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
            raise LearnerLost(f"a learner died during the weight push ({what}): {exc}", in_weight_push=True) from exc
    for _, exc in errors:
        if isinstance(exc, WORKER_DIED):
            raise exc
    if errors:
        raise errors[0][1]
    return results


class WeightSync:
    """Driver side: hosts the rendezvous store, (re)forms the group for the current fleet, and starts each push
    on the learner ranks (senders) and the rollout workers (receivers) at once.

    Every learner rank and every worker needs ``join_weight_sync(host, port, name, rank, world, timeout_s)``; the
    learner ranks ``send_weights(version, bucket_bytes, dtype, senders)``, the workers ``receive_weights()``."""

    kind = "network"  # (a run's summary.json says which sync it used)

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

    @staticmethod
    def _key(members: list) -> tuple:
        return tuple(member_key(m) for m in members)

    def needs_new_group(self, learners: list, workers: list) -> bool:
        """Whether a push to these members forms a new group (the fleet changed, or the last push failed)."""
        return self._key([*learners, *workers]) != self.members

    def form_group(self, learners: list, workers: list) -> None:
        """Form the group of these members unless it is the current one (``push`` does it first). Sync ranks: the
        learner ranks first (0..L-1, each its own rank), then the workers."""
        members = [*learners, *workers]
        key = self._key(members)
        if key == self.members:
            return
        self.generation += 1
        name, world = f"{self.prefix}_{self.generation}/", len(members)
        one_machine = sum(n["Alive"] for n in ray.nodes()) == 1  # (a local Ray): loopback only
        host = "127.0.0.1" if one_machine else ray.util.get_node_ip_address()
        args = (host, self.store.port, name)
        gather_push(
            [m.join_weight_sync.remote(*args, rank, world, self.timeout_s) for rank, m in enumerate(members)],
            "forming the group",
            self.timeout_s,
            n_learners=len(learners),
        )
        self.members = key

    def push(self, learners: list, workers: list, version: int) -> float:
        """Send the learners' current weights to ``workers`` as ``version``; returns the milliseconds it took.
        ``learners``: every learner rank's actor, rank 0 first (each sends its own shard)."""
        t0 = time.perf_counter()
        try:
            self.form_group(learners, workers)
            sends = [r.send_weights.remote(version, self.bucket_bytes, self.dtype, len(learners)) for r in learners]
            recvs = [w.receive_weights.remote() for w in workers]
            results = gather_push(sends + recvs, "sending", self.timeout_s, n_learners=len(sends))
        except BaseException:
            self.members = ()  # the members dropped their ends of the group
            raise
        got = results[len(sends) :]
        if got != [version] * len(workers):
            raise RuntimeError(f"weight push {version}: the workers report versions {got}")
        self.last_ms = (time.perf_counter() - t0) * 1000
        sent = results[: len(sends)]
        self.last = {  # learner rank 0's breakdown; bytes: every sender's, the model once
            **sent[0],
            "bytes": sum(r["bytes"] for r in sent),
            "ms": self.last_ms,
            "slowest_sender_s": max(r["learner_s"] for r in sent),
        }
        return self.last_ms

    def close(self) -> None:
        self.store = None


class ColocatedSync:
    """Driver side of the colocated handoff (rapo_ray/workers/colocated.py); the same calls as ``WeightSync`` (``push``, ``reset``, ``close``,
    ``needs_new_group``), so the trainer and ``push_weights`` take either.

    Every learner rank needs ``export_weights(version, dtype, senders, prefix)`` and every worker
    ``import_weights(segments)``."""

    kind = "colocated"  # (a run's summary.json says which sync it used)

    def __init__(self, timeout_s: float = 600.0, dtype: str = "float32"):
        self.timeout_s, self.dtype = timeout_s, dtype
        self.prefix = f"rapo_weights_{os.getpid()}_{int(time.time() * 1000) % 10**9}"
        self.last_ms = 0.0
        self.last: dict = {}

    def reset(self) -> None:
        """Nothing to re-form: each push hands every worker the handles afresh."""

    def needs_new_group(self, learners: list, workers: list) -> bool:
        return False  # (a dead worker fails its own import; ``push_weights`` replaces it and pushes again)

    def push(self, learners: list, workers: list, version: int) -> float:
        """Export ``version`` on every learner rank, then import it on every worker; returns the milliseconds."""
        t0 = time.perf_counter()
        exported = gather_push(
            [r.export_weights.remote(version, self.dtype, len(learners), self.prefix) for r in learners],
            "exporting",
            self.timeout_s,
            n_learners=len(learners),
        )
        t1 = time.perf_counter()
        segments = [e["segment"] for e in exported]
        got = gather_push([w.import_weights.remote(segments) for w in workers], "loading", self.timeout_s, 0)
        if got != [version] * len(workers):
            raise RuntimeError(f"weight push {version}: the workers report versions {got}")
        self.last_ms = (time.perf_counter() - t0) * 1000
        self.last = {
            **{k: v for k, v in exported[0].items() if k != "segment"},
            "bytes": sum(e["segment"].nbytes for e in exported),
            "export_s": t1 - t0,
            "import_s": time.perf_counter() - t1,
            "ms": self.last_ms,
            "slowest_sender_s": max(e["learner_s"] for e in exported),
        }
        return self.last_ms

    def close(self) -> None:
        """Remove CPU segments left under this run's prefix on this machine (a learner that was killed cannot)."""
        for path in glob.glob(os.path.join(shared_dir(), f"{self.prefix}-*")):
            try:
                os.unlink(path)
            except OSError:
                pass


class SyncMember:
    """What a learner rank and a rollout worker share: their end of the run's current weight-sync group."""

    _sync_group: SyncGroup | None = None

    def join_weight_sync(self, host: str, port: int, name: str, rank: int, world: int, timeout_s: float) -> bool:
        """Become ``rank`` of the weight-sync group ``name``, leaving the previous one (a failed join leaves none)."""
        previous, self._sync_group = self._sync_group, None
        self._sync_group = SyncGroup.join(previous, host, port, name, rank, world, timeout_s)
        return True
