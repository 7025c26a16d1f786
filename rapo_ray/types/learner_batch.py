"""``LearnerBatch``: what the learner ranks compute on, as padded tensors, built once per step.

The fleet's trajectories become one ``LearnerBatch`` (``from_trajectories``) before the old-policy pass. From then
on the learner path only slices it: rows for a rank and a micro-batch (``select``, which trims the padding to the
longest selected row), rows that weigh nothing to keep ranks in step (``padding``). Ranks receive tensors and
return tensors; nothing goes back to per-token Python lists.

Shapes (B rows, T = the longest prompt + response of the batch; positions ``1..T-1`` are targets, so every
per-token field is target-aligned and has T - 1 columns):

    field            shape     dtype    meaning
    input_ids        [B, T]    int32    prompt + response, right-padded with the model's pad id (``long_ids()``)
    loss_mask        [B, T-1]  uint8    1 where the target is a generated token (what the loss trains)
    old_logprobs     [B, T-1]  float32  log pi_old of each generated target, 0 elsewhere  (LearnerGroup.forward_old,
                                        or the update's own forward when the pass is skipped: training/old_pass.py)
    entropies        [B, T-1]  float32  full-vocabulary entropy at each generated target   (the same)
    advantage        [B]       float32  (LearnerGroup.update, from the step's advantages)
    shaping          [B]       float32  importance shaping factor, 1 without it
    behaviour_logprobs [B, T-1] float32 the engine's log-prob of each generated target, 0 elsewhere; only with
                                        ``algo.behaviour_correction`` (``from_trajectories(behaviour=True)``)
    prompt_len       [B]       int64    prompt tokens of each row
    length           [B]       int64    prompt + response tokens of each row
    row              [B]       int64    the row's index in the step's TrajectoryBatch; -1 for a padding row

and, computed from the lengths rather than stored (nothing that can be derived travels):

    attention_mask   [B, T]    int64    1 on real tokens
    response_mask    [B, T-1]  float32  1 where the target is a response token (generated, tool result, retrieved)

Row i's response targets are columns ``prompt_len[i] - 1 .. length[i] - 2`` (``response_span``). The stored dtypes
are the narrowest that hold the values exactly; a batch pickles its tensors as numpy arrays (one buffer each, read
back without a copy).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``'s buffer; copied first when read-only (Ray hands out read-only views of its object store,
    and torch warns about, and must never write into, those)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


# Stored per-token fields ([B, T] or [B, T-1]: trimmed by ``select``); the others are per row ([B]).
_PER_TOKEN = ("input_ids", "loss_mask", "old_logprobs", "entropies", "behaviour_logprobs")


@dataclass
class LearnerBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    advantage: torch.Tensor | None = None
    shaping: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    # ------------------------------------------------------------ building

    @classmethod
    def from_trajectories(cls, trajectories: Sequence, pad_id: int, behaviour: bool = False) -> "LearnerBatch":
        """One row per trajectory, in order (``row`` = its index); with ``behaviour``, the engine's log-probs of the
        response tokens as ``behaviour_logprobs`` (for ``algo.behaviour_correction``)."""
        B = len(trajectories)
        prompt_len = torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.long)
        length = prompt_len + torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
        T = max(int(length.max()) if B else 2, 2)
        ids = np.full((B, T), pad_id, dtype=np.int32)
        mask = np.zeros((B, T - 1), dtype=np.uint8)
        engine = np.zeros((B, T - 1), dtype=np.float32) if behaviour else None
        for i, t in enumerate(trajectories):
            n, s = int(length[i]), int(prompt_len[i]) - 1
            ids[i, : s + 1] = t.prompt_ids
            ids[i, s + 1 : n] = t.response_ids
            mask[i, s : n - 1] = t.loss_mask
            if engine is not None:
                if len(t.logprobs) != len(t.response_ids):
                    raise ValueError(
                        f"trajectory {t.group_id}/{t.slot}: {len(t.logprobs)} engine log-probs for "
                        f"{len(t.response_ids)} response tokens; algo.behaviour_correction needs the engine's"
                    )
                engine[i, s : n - 1] = t.logprobs
        out = cls(torch.from_numpy(ids), torch.from_numpy(mask), prompt_len, length, torch.arange(B, dtype=torch.long))
        out.behaviour_logprobs = None if engine is None else torch.from_numpy(engine)
        return out

    @classmethod
    def padding(cls, n: int, pad_id: int, like: "LearnerBatch | None" = None) -> "LearnerBatch":
        """``n`` one-token-prompt, one-token-response rows that weigh nothing in the loss (all-zero masks, advantage
        0, shaping 1): they keep learner ranks in step, since FSDP's collectives need every rank in every
        forward/backward. Stage fields are filled where ``like`` has them."""
        zeros = torch.zeros((n, 1), dtype=torch.float32)
        out = cls(
            input_ids=torch.full((n, 2), pad_id, dtype=torch.int32),
            loss_mask=torch.zeros((n, 1), dtype=torch.uint8),
            prompt_len=torch.ones(n, dtype=torch.long),
            length=torch.full((n,), 2, dtype=torch.long),
            row=torch.full((n,), -1, dtype=torch.long),
        )
        if like is None or like.old_logprobs is not None:
            out.old_logprobs = zeros.clone()
        if like is None or like.entropies is not None:
            out.entropies = zeros.clone()
        if like is None or like.advantage is not None:
            out.advantage, out.shaping = torch.zeros(n), torch.ones(n)
        if like is not None and like.behaviour_logprobs is not None:
            out.behaviour_logprobs = zeros.clone()
        return out

    # ------------------------------------------------------------ slicing and joining

    def select(self, indices: Sequence[int] | torch.Tensor, trim: bool = True) -> "LearnerBatch":
        """The rows ``indices``, in that order, padded only to the longest of them (``trim=False``: keep this batch's
        width, so that parts of it can be joined again as Arrow blocks of one schema)."""
        idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.long)
        T = max(int(self.length[idx].max()) if len(idx) else 2, 2) if trim else int(self.input_ids.shape[1])
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name in _PER_TOKEN:
                out[f.name] = v[idx, : T if f.name == "input_ids" else T - 1]
            else:
                out[f.name] = v[idx]
        return LearnerBatch(**out)

    @classmethod
    def concat(cls, parts: Sequence["LearnerBatch"], pad_id: int) -> "LearnerBatch":
        """Rows of ``parts`` in order, padded to the longest; a stage field is kept when every part has it."""
        T = max(p.input_ids.shape[1] for p in parts)
        out = {}
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            if any(v is None for v in vals):
                out[f.name] = None
            elif f.name in _PER_TOKEN:
                width = T if f.name == "input_ids" else T - 1
                fill = pad_id if f.name == "input_ids" else 0
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in vals])
            else:
                out[f.name] = torch.cat(vals)
        return cls(**out)

    def with_advantages(self, advantage: Sequence[float], shaping: Sequence[float]) -> "LearnerBatch":
        return replace(
            self,
            advantage=torch.as_tensor(advantage, dtype=torch.float32),
            shaping=torch.as_tensor(shaping, dtype=torch.float32),
        )

    def require(self, *names: str) -> None:
        """Raise if a stage that must have run has not filled its fields (a stage called out of order)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"LearnerBatch: {missing} not filled yet (forward_old fills the first two, update the rest)"
            )

    # ------------------------------------------------------------ crossing a process boundary

    def __getstate__(self) -> dict:
        return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: (from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in state.items()})

    # ------------------------------------------------------------ views

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, T] int64: 1 on each row's real tokens."""
        return (torch.arange(self.input_ids.shape[1]) < self.length[:, None]).long()

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, T-1] float32: 1 where the target is a response token."""
        pos = torch.arange(self.input_ids.shape[1] - 1)
        return ((pos >= self.prompt_len[:, None] - 1) & (pos < self.length[:, None] - 1)).float()

    def long_ids(self) -> torch.Tensor:
        """[B, T] int64 input ids, what an embedding lookup takes."""
        return self.input_ids.long()

    def response_span(self, i: int) -> tuple[int, int]:
        """Target columns of row ``i``'s response tokens: [prompt_len - 1, length - 1)."""
        return int(self.prompt_len[i]) - 1, int(self.length[i]) - 1

    def response_values(self, name: str, i: int) -> torch.Tensor:
        """Row ``i`` of a per-token field over its response tokens only ([L_i], aligned with ``response_ids``)."""
        s, e = self.response_span(i)
        return getattr(self, name)[i, s:e]

    def tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return int(self.length.sum())

    # ------------------------------------------------------------ the Ray Data feed (streaming_split)

    def to_arrow(self, extra: dict | None = None):
        """The fields the loss needs as an Arrow table, one row per batch row (per-token fields as fixed-size lists
        over the batch's width: columnar buffers, not Python lists); ``extra``: more columns of the same length."""
        import pyarrow as pa

        self.require("old_logprobs", "advantage", "shaping")

        def matrix(t: torch.Tensor):
            flat = pa.array(t.contiguous().numpy().reshape(-1))
            return pa.FixedSizeListArray.from_arrays(flat, t.shape[1])

        per_token = ("input_ids", "loss_mask", "old_logprobs")
        cols = {name: matrix(getattr(self, name)) for name in per_token}
        if self.behaviour_logprobs is not None:
            cols["behaviour_logprobs"] = matrix(self.behaviour_logprobs)
        cols |= {name: pa.array(getattr(self, name).numpy()) for name in ("advantage", "shaping", "prompt_len")}
        cols |= {"length": pa.array(self.length.numpy()), "row": pa.array(self.row.numpy())}
        return pa.table(cols | dict(extra or {}))

    @classmethod
    def from_arrow(cls, table) -> "LearnerBatch":
        """Inverse of ``to_arrow`` for a table (or a concatenation of tables) read back from Ray Data."""

        def matrix(name: str, dtype) -> torch.Tensor:
            col = table.column(name).combine_chunks()
            width = col.type.list_size
            return torch.from_numpy(col.flatten().to_numpy(zero_copy_only=False).reshape(-1, width).astype(dtype))

        def vector(name: str, dtype) -> torch.Tensor:
            return torch.from_numpy(table.column(name).to_numpy().astype(dtype))

        return cls(
            input_ids=matrix("input_ids", np.int32),
            loss_mask=matrix("loss_mask", np.uint8),
            prompt_len=vector("prompt_len", np.int64),
            length=vector("length", np.int64),
            row=vector("row", np.int64),
            old_logprobs=matrix("old_logprobs", np.float32),
            advantage=vector("advantage", np.float32),
            shaping=vector("shaping", np.float32),
            behaviour_logprobs=matrix("behaviour_logprobs", np.float32)
            if "behaviour_logprobs" in table.column_names
            else None,
        )
