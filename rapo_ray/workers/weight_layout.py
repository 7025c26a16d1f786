"""The layout of the weights for a push, shared by both transports (rapo_ray/workers/sync.py over gloo,
rapo_ray/workers/colocated.py through shared memory): buckets of whole tensors at 64-byte aligned offsets, and each
sender's rows of them under FSDP2's ``Shard(0)`` (``segment``), packed in the engines' dtype and put back in place.
Torch only (no Ray): the GPU check imports it on a box without Ray.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

_ALIGN = 64  # byte offset alignment inside a bucket or segment: every dtype's view of its slice is aligned


def aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def shard_rows(d0: int, senders: int) -> tuple[int, ...]:
    """Rows of dim 0 that each of ``senders`` ranks holds under FSDP2's ``Shard(0)`` (``torch.chunk`` pieces:
    c = ceil(d0 / senders) rows each, the last ones fewer or none). [senders] ints summing to d0."""
    c = -(-d0 // senders) if senders else 0
    return tuple(max(0, min(c, d0 - r * c)) for r in range(senders))


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits in a bucket, and which sender holds which of its rows."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    offset: int  # bytes from the bucket's start
    nbytes: int
    rows: tuple[int, ...] = ()  # rows of dim 0 per sender (``shard_rows``); () = sender 0 holds the whole tensor

    def rows_of(self, sender: int) -> tuple[int, int]:
        """(first row, row count) that ``sender`` holds; a 0-d tensor counts as one row."""
        d0 = self.shape[0] if self.shape else 1
        rows = self.rows or (d0,)
        if sender >= len(rows):
            return 0, 0
        return sum(rows[:sender]), rows[sender]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // (self.shape[0] if self.shape else 1) if self.nbytes else 0


def plan_buckets(entries: list[tuple], bucket_bytes: int) -> list[list[TensorSlot]]:
    """Lay ``(name, shape, dtype)`` or ``(name, shape, dtype, rows)`` entries out in buckets of at most
    ``bucket_bytes`` (a tensor larger than that gets a bucket of its own; a tensor never spans two), in order, each
    offset aligned to 64 bytes. ``rows``: see ``TensorSlot.rows``."""
    buckets: list[list[TensorSlot]] = []
    cur: list[TensorSlot] = []
    used = 0
    for name, shape, dtype, *rows in entries:
        nbytes = math.prod(shape) * _element_size(dtype)
        start = aligned(used)
        if cur and start + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, start = [], 0
        cur.append(TensorSlot(name, tuple(shape), dtype, start, nbytes, tuple(rows[0]) if rows else ()))
        used = start + nbytes
    if cur:
        buckets.append(cur)
    return buckets


def bucket_size(bucket: list[TensorSlot]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes


@dataclass(frozen=True)
class Piece:
    """One sender's rows of one tensor: bytes ``[offset, offset + nbytes)`` of its segment belong at
    ``slot.offset + first_row * slot.row_bytes`` in the bucket."""

    slot: TensorSlot
    first_row: int
    n_rows: int
    offset: int
    nbytes: int


def segment(bucket: list[TensorSlot], sender: int) -> list[Piece]:
    """The rows of ``bucket`` that ``sender`` holds, laid out in tensor order with 64-byte aligned offsets (as
    ``plan_buckets`` lays out whole tensors). A sender that holds every row of the bucket has the bucket's own
    layout: its segment is the bucket, received in place."""
    pieces, used = [], 0
    for slot in bucket:
        first, n = slot.rows_of(sender)
        if n == 0:
            continue
        start = aligned(used)
        pieces.append(Piece(slot, first, n, start, n * slot.row_bytes))
        used = start + n * slot.row_bytes
    return pieces


def is_whole(pieces: list[Piece], bucket: list[TensorSlot]) -> bool:
    return len(pieces) == len(bucket) and all(p.offset == p.slot.offset and p.nbytes == p.slot.nbytes for p in pieces)


def message_size(pieces: list[Piece]) -> int:
    return pieces[-1].offset + pieces[-1].nbytes


def place(piece: Piece) -> tuple[int, int]:
    """Byte range of ``piece`` in its bucket: its rows are contiguous there (row-major, split on dim 0)."""
    at = piece.slot.offset + piece.first_row * piece.slot.row_bytes
    return at, at + piece.nbytes


def pack_segment(out: torch.Tensor, pieces: list[Piece], local) -> torch.Tensor:
    """Write each piece's rows into ``out`` ([>= segment size] uint8, CPU), cast to the slot's dtype on the way.
    ``local(name)``: the rows this sender holds of that tensor (any dtype, any device). Returns ``out``."""
    for p in pieces:
        rows = local(p.slot.name)
        want = (p.n_rows, *p.slot.shape[1:]) if p.slot.shape else ()
        if tuple(rows.shape) != want:
            raise ValueError(f"{p.slot.name}: this sender holds {tuple(rows.shape)}, the plan says {want}")
        dst = out[p.offset : p.offset + p.nbytes].view(getattr(torch, p.slot.dtype)).view(want)
        dst.copy_(rows.detach())
    return out


def unpack(buf: torch.Tensor, bucket: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Views of ``buf`` ([bucket_size] uint8) as the bucket's tensors (no copy)."""
    return {s.name: buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in bucket}


def spec_to_json(buckets: list[list[TensorSlot]]) -> bytes:
    return json.dumps([[list(s.__dict__.values()) for s in b] for b in buckets]).encode()


def spec_from_json(raw: bytes) -> list[list[TensorSlot]]:
    return [[TensorSlot(n, tuple(sh), dt, off, nb, tuple(r)) for n, sh, dt, off, nb, r in b] for b in json.loads(raw)]


class ReusedBuffers:
    """Flat buffers kept from one bucket (and push) to the next: a fresh multi-MB allocation per bucket is page
    faults on every use, which cost more than the copies themselves (at the 0.5B shape, about twice the time)."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.turn = 0  # which of two alternating buffers a caller fills next

    def get(self, name: str, numel: int, dtype: torch.dtype = torch.uint8, device="cpu") -> torch.Tensor:
        key = (name, dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]
