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
                                        or the update's own forward when the pass is skipped: algos/old_pass.py)
    entropies        [B, T-1]  float32  full-vocabulary entropy at each generated target   (the same)
    signal           {name: [B] or [B, T-1]} float32
                                        the algorithm's outputs by the names it declares (``Algorithm.outputs``;
                                        data_flow.compute_advantages): per row, or per token at the response's
                                        targets (0 elsewhere). The loss reads ``advantage`` and, if present,
                                        ``shaping`` (RAPO's importance shaping factor)
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

from rapo_ray.core.errors import require_filled


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor over ``a``'s buffer; copied first when read-only (Ray hands out read-only views of its object store,
    and torch warns about, and must never write into, those)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


@dataclass
class LearnerBatch:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    prompt_len: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    signal: dict[str, torch.Tensor] | None = None
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
        """``n`` one-token-prompt, one-token-response rows that weigh nothing in the loss (all-zero masks and
        signal): they keep learner ranks in step, since FSDP's collectives need every rank in every
        forward/backward. Stage fields are filled where ``like`` has them (without ``like``, on a rank that got no
        rows: the pass's and ``advantage``, the one output every algorithm declares and the loss reads)."""
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
        if like is None:
            out.signal = {"advantage": torch.zeros(n)}
        elif like.signal is not None:
            out.signal = {k: torch.zeros(n) if v.dim() == 1 else torch.zeros((n, 1)) for k, v in like.signal.items()}
        if like is not None and like.behaviour_logprobs is not None:
            out.behaviour_logprobs = zeros.clone()
        return out

    # ------------------------------------------------------------ slicing and joining

    def select(self, indices: Sequence[int] | torch.Tensor, trim: bool = True) -> "LearnerBatch":
        """The rows ``indices``, in that order, padded only to the longest of them (``trim=False``: keep this batch's
        width, so that parts of it can be joined again as Arrow blocks of one schema)."""
        idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.long)
        T = max(int(self.length[idx].max()) if len(idx) else 2, 2) if trim else int(self.input_ids.shape[1])

        def rows_of(x: torch.Tensor, width: int) -> torch.Tensor:  # a per-token tensor is cut to ``width`` columns
            return x[idx] if x.dim() == 1 else x[idx, :width]

        out = {}
        for f in fields(self):
            v, width = getattr(self, f.name), T if f.name == "input_ids" else T - 1
            if v is None:
                out[f.name] = None
            elif f.name == "signal":
                out[f.name] = {k: rows_of(x, width) for k, x in v.items()}
            else:
                out[f.name] = rows_of(v, width)
        return LearnerBatch(**out)

    @classmethod
    def concat(cls, parts: Sequence["LearnerBatch"], pad_id: int) -> "LearnerBatch":
        """Rows of ``parts`` in order, padded to the longest; a stage field is kept when every part has it."""
        T = max(p.input_ids.shape[1] for p in parts)

        def joined(vals: list[torch.Tensor], width: int, fill=0) -> torch.Tensor:  # per row, or per token padded
            if vals[0].dim() == 1:
                return torch.cat(vals)
            return torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill) for v in vals])

        out = {}
        for f in fields(cls):
            vals = [getattr(p, f.name) for p in parts]
            width, fill = (T, pad_id) if f.name == "input_ids" else (T - 1, 0)
            if any(v is None for v in vals):
                out[f.name] = None
            elif f.name == "signal":
                out[f.name] = {k: joined([v[k] for v in vals], width) for k in vals[0]}
            else:
                out[f.name] = joined(vals, width, fill)
        return cls(**out)

    def with_signal(self, outputs: dict[str, Sequence], per_token: Sequence[str] = ()) -> "LearnerBatch":
        """This batch with the algorithm's ``outputs`` as ``signal`` tensors: a per-row output is [B] floats; one named
        in ``per_token`` is a sequence of B arrays, each over its row's response tokens ([L_i], like
        ``response_ids``), placed at the row's response targets of a [B, T-1] tensor (0 elsewhere)."""
        signal = {}
        for name, values in outputs.items():
            if name not in per_token:
                signal[name] = torch.as_tensor(np.asarray(values, dtype=np.float32))
                continue
            grid = torch.zeros(self.loss_mask.shape, dtype=torch.float32)
            for i, row in enumerate(values):
                s, e = self.response_span(i)
                if len(row) != e - s:
                    raise ValueError(
                        f"per-token output {name!r}: row {i} has {len(row)} values for {e - s} response tokens"
                    )
                grid[i, s:e] = torch.as_tensor(np.asarray(row, dtype=np.float32))
            signal[name] = grid
        return replace(self, signal=signal)

    def require(self, *names: str) -> None:
        """Raise if a stage that must have run has not filled its fields (a stage called out of order)."""
        require_filled(self, names, "forward_old fills old_logprobs and entropies, compute_advantages the signal")

    # ------------------------------------------------------------ crossing a process boundary

    def __getstate__(self) -> dict:
        def plain(v):
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v.numpy() if isinstance(v, torch.Tensor) else v

        return {k: plain(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        def tensor(v):
            if isinstance(v, dict):
                return {k: tensor(x) for k, x in v.items()}
            return from_numpy(v) if isinstance(v, np.ndarray) else v

        self.__dict__.update({k: tensor(v) for k, v in state.items()})

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
        """Row ``i`` of a per-token field (or per-token ``signal`` output) over its response tokens only ([L_i],
        aligned with ``response_ids``)."""
        s, e = self.response_span(i)
        values = self.signal[name] if self.signal is not None and name in self.signal else getattr(self, name)
        return values[i, s:e]

    def row_signal(self, i: int) -> dict:
        """Row ``i``'s signal: a float per per-row output, a list over its response tokens per per-token one."""
        return {
            k: float(v[i]) if v.dim() == 1 else self.response_values(k, i).tolist()
            for k, v in (self.signal or {}).items()
        }

    def tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return int(self.length.sum())

    # ------------------------------------------------------------ the Ray Data feed (streaming_split)

    def to_arrow(self, extra: dict | None = None):
        """The fields the loss needs as an Arrow table, one row per batch row (per-token fields as fixed-size lists
        over the batch's width: columnar buffers, not Python lists); ``extra``: more columns of the same length."""
        import pyarrow as pa

        self.require("old_logprobs", "signal")

        def matrix(t: torch.Tensor):
            flat = pa.array(t.contiguous().numpy().reshape(-1))
            return pa.FixedSizeListArray.from_arrays(flat, t.shape[1])

        per_token = ("input_ids", "loss_mask", "old_logprobs")
        cols = {name: matrix(getattr(self, name)) for name in per_token}
        if self.behaviour_logprobs is not None:
            cols["behaviour_logprobs"] = matrix(self.behaviour_logprobs)
        cols |= {
            f"signal.{k}": pa.array(v.numpy()) if v.dim() == 1 else matrix(v) for k, v in self.signal.items()
        }  # the algorithm's outputs, by name
        cols |= {name: pa.array(getattr(self, name).numpy()) for name in ("prompt_len", "length", "row")}
        return pa.table(cols | dict(extra or {}))

    @classmethod
    def from_arrow(cls, table) -> "LearnerBatch":
        """Inverse of ``to_arrow`` for a table (or a concatenation of tables) read back from Ray Data."""
        import pyarrow as pa

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
            signal={
                name[len("signal.") :]: matrix(name, np.float32)
                if pa.types.is_fixed_size_list(table.schema.field(name).type)
                else vector(name, np.float32)
                for name in table.column_names
                if name.startswith("signal.")
            },
            behaviour_logprobs=matrix("behaviour_logprobs", np.float32)
            if "behaviour_logprobs" in table.column_names
            else None,
        )
