"""Colocated weight handoff (``resources.colocate``): the learner ranks and the rollout engines on one machine (one
GPU, shared), so a push is a copy into memory that both sides map and a copy out of it; no socket, no collective.

    driver (sync.ColocatedSync)  learner rank r (export_weights)                rollout worker (import_weights)
    export on every rank,   ->   its rows of every tensor (``segment``) into  ->   every rank's rows put together in
    then import on every         its shared buffer, in the engines' dtype;        place (in place when one rank holds
    worker                       returns a ``SharedSegment`` (a handle)           the whole model), then loaded

The shared buffer is, on the CPU, a file in /dev/shm that both processes map (``torch.from_file(shared=True)``);
on CUDA, the learner's device buffer, opened by the engine through a CUDA IPC handle (torch.multiprocessing's
``reduce_tensor``), so the bytes never leave the GPU. Which one is decided by the learner's device; everything
else (the layout, the packing, where each row goes) is the network sync's (rapo_ray/workers/weight_layout.py), with
the whole model as one bucket. Only handles (a path, or an IPC handle of a few hundred bytes) travel through Ray.
Torch only (no Ray): the GPU check runs the handoff on a box without Ray.

A learner keeps its buffer from push to push and overwrites it in the next push: the driver imports on every
worker before it returns, and exports the next version only after that, so no worker reads a buffer being written.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from rapo_ray.workers.weight_layout import (
    ReusedBuffers,
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


def shared_dir() -> str:
    """Where CPU segments live: /dev/shm (memory, not disk) where the system has it, else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class SharedSegment:
    """One learner rank's export of one version: where its rows are and how the whole model is laid out.

    ``spec``: the layout (``spec_to_json`` of one bucket), the same on every rank; ``kind``: "shm" (``path``, a
    file of ``nbytes`` bytes), "cuda" (``ipc``: ``reduce_tensor``'s (rebuild function, arguments) of a uint8
    device tensor of ``nbytes``) or "empty" (this rank holds no rows)."""

    version: int
    rank: int
    senders: int
    spec: bytes
    kind: str
    nbytes: int
    path: str = ""
    ipc: tuple | None = None


def one_bucket(entries: list[tuple]) -> list:
    """The whole model as one bucket (``plan_buckets`` with no size limit): a colocated push has no wire to pace."""
    buckets = plan_buckets(entries, sys.maxsize)
    if len(buckets) != 1:
        raise ValueError(f"weight export: {len(entries)} tensors, nothing to send")
    return buckets[0]


class SegmentExporter:
    """A learner rank's side: packs its rows into a buffer the engines can map, kept from push to push."""

    def __init__(self, rank: int):
        self.rank = rank
        self._buffer: torch.Tensor | None = None
        self._path = ""  # the current CPU segment's file ("" on CUDA or before the first export)
        self._generation = 0  # a larger buffer is a new file: a worker's old mapping never sees a shorter one

    def export(self, version: int, entries: list[tuple], local, senders: int, prefix: str, device) -> SharedSegment:
        """Pack this rank's rows of ``entries`` (name, shape, dtype, rows per sender) from ``local(name)`` into the
        shared buffer on ``device``'s kind of memory; the handle says where. ``prefix`` names CPU files (the
        driver removes what is left under it when the run ends)."""
        bucket = one_bucket(entries)
        spec = spec_to_json([bucket])
        pieces = segment(bucket, self.rank)
        n = message_size(pieces) if pieces else 0
        if n == 0:
            return SharedSegment(version, self.rank, senders, spec, "empty", 0)
        device = torch.device(device)
        buf = self._buffer_of(n, device, prefix)
        pack_segment(buf, pieces, local)
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream(device).synchronize()  # the engine reads on its own stream, in its own process
            return SharedSegment(version, self.rank, senders, spec, "cuda", n, ipc=reduce_tensor(buf))
        return SharedSegment(version, self.rank, senders, spec, "shm", n, path=self._path)

    def _buffer_of(self, n: int, device: torch.device, prefix: str) -> torch.Tensor:
        buf = self._buffer
        if buf is not None and buf.device == device and buf.numel() >= n:
            return buf[:n]
        self.close()
        if device.type == "cuda":
            self._buffer = torch.empty(n, dtype=torch.uint8, device=device)
        else:
            self._generation += 1
            self._path = os.path.join(shared_dir(), f"{prefix}-rank{self.rank}-{os.getpid()}-{self._generation}")
            self._buffer = torch.from_file(self._path, shared=True, size=n, dtype=torch.uint8)
        return self._buffer

    def close(self) -> None:
        """Drop the buffer; a CPU segment's file goes with it (a worker's open mapping stays valid until unmapped)."""
        self._buffer = None
        if self._path:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = ""


class SegmentImporter:
    """A rollout worker's side: maps each rank's segment and puts the rows together into the full state dict."""

    def __init__(self):
        self._mapped: dict[int, tuple[tuple, torch.Tensor]] = {}  # rank -> (what it maps, the tensor)
        self._specs: tuple[bytes, list] = (b"", [])
        self.buffers = ReusedBuffers()
        self.last: dict = {}  # seconds mapping and putting rows in place (bench_sync reports them)

    def open(self, seg: SharedSegment) -> torch.Tensor:
        """A [nbytes] uint8 view of ``seg``'s buffer, mapped once per file (or IPC handle) and kept."""
        key = (seg.path, seg.nbytes)
        known = self._mapped.get(seg.rank)
        if seg.kind == "shm" and known is not None and known[0] == key:
            return known[1]
        if seg.kind == "shm":
            t = torch.from_file(seg.path, shared=True, size=seg.nbytes, dtype=torch.uint8)
        elif seg.kind == "cuda":
            rebuild, args = seg.ipc  # (torch keeps the opened IPC handle cached by the handle itself)
            t = rebuild(*args)[: seg.nbytes]
        else:
            raise ValueError(f"weight import: rank {seg.rank}'s segment is of kind {seg.kind!r}, not shm or cuda")
        self._mapped[seg.rank] = (key, t)
        return t

    def bucket_of(self, spec: bytes) -> list:
        if self._specs[0] != spec:
            self._specs = (spec, spec_from_json(spec)[0])
        return self._specs[1]

    def state_dict(self, segments: list[SharedSegment]) -> tuple[int, dict[str, torch.Tensor]]:
        """The version and the full state dict of one export (every learner rank's ``SharedSegment``, rank order).
        Its tensors are views of the learner's buffer or of one kept here: the caller copies them (engines'
        ``load_weights`` do) before the next push."""
        t0 = time.perf_counter()
        first = segments[0]
        if [s.rank for s in segments] != list(range(first.senders)) or {s.version for s in segments} != {first.version}:
            raise ValueError(
                f"weight import: expected one segment per learner rank 0..{first.senders - 1} of one version, got "
                f"ranks {[s.rank for s in segments]} of versions {sorted({s.version for s in segments})}"
            )
        if any(s.spec != first.spec for s in segments):
            raise RuntimeError(f"weight push {first.version}: the learner ranks lay the weights out differently")
        bucket = self.bucket_of(first.spec)
        whole = [s for s in segments if s.kind != "empty" and is_whole(segment(bucket, s.rank), bucket)]
        if whole:  # one rank holds every row: its buffer is the bucket, read in place
            buf = self.open(whole[0])
        else:
            mapped = {s.rank: self.open(s) for s in segments if s.kind != "empty"}
            device = next(iter(mapped.values())).device if mapped else torch.device("cpu")
            buf = self.buffers.get("bucket", bucket_size(bucket), device=device)
            for rank, src in mapped.items():
                for p in segment(bucket, rank):
                    lo, hi = place(p)
                    buf[lo:hi].copy_(src[p.offset : p.offset + p.nbytes])
        self.last = {"import_s": time.perf_counter() - t0}
        return first.version, unpack(buf, bucket)
