"""Torch inference engine: continuous batching over a slot KV cache, exact logprobs and entropies.

The engine where vLLM does not install (and on CPU for serving), and the fast path for unit tests.

For Qwen2 / Llama / Mistral-shaped decoders (``SlotDecoder.unsupported`` says why another model is not) the
engine keeps one preallocated KV-cache slot per live request and runs its own lean forward pass over the
HF model's modules (embedding, norms, projections, MLP and rotary embedding are the model's own; only the
cache and the attention call are ours). That buys two things over ``model.generate``:

- **continuous batching**: a request is admitted into a free slot between two decode steps, whether it came
  in the same ``generate`` call or from another thread while a batch was decoding; a finished request frees
  its slot at once (the last live slot moves into the hole, so live requests are always slots ``0..n-1``
  and the cache is read as a view, never gathered);
- no per-step cost for HF's cache objects, mask builders and generation utilities, which dominate small
  models on CPU.

On a GPU the decode step of a small model is bound by Python and kernel launches, not by the GPU (60-126 ms per
step at any batch on an H200). There the step runs at fixed shapes (``StaticDecoder``: batches padded to powers of
two, attention over the whole cache under a mask) and is captured once per shape as a CUDA graph, then replayed.

Any other causal LM runs through the generic path: left-padded batches on HF's ``DynamicCache``
(finished rows evicted), no continuous batching.

Threading: ``generate`` may be called from several threads. Whichever caller holds the step lock runs one
scheduler step for every live request, so requests of concurrent callers share decode steps.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from rapo_ray.core.devices import make_generator
from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams, stop_string_at

_SLOT_MODEL_TYPES = ("qwen2", "llama", "mistral")


log = logging.getLogger("rapo_ray.engines.torch_engine")


class SlotDecoder:
    """Lean forward pass of a Qwen2/Llama-shaped HF model on a per-request KV cache.

    Cache layout per layer: ``k, v`` of shape [slots, kv_heads, capacity, head_dim]. Both grow by doubling when a
    step needs more: slots up to ``max_slots`` as requests are admitted, capacity up to ``max_position_embeddings``
    as one runs longer. Memory is therefore the most requests live at once x the longest live sequence, not
    ``max_slots`` x it (docs/RESULTS.md, Performance by component): for long contexts on big models, lower
    ``max_batch_size`` (vLLM's paged cache is the engine for those).
    """

    def __init__(self, model, max_slots: int, initial_capacity: int = 256, initial_slots: int = 8):
        self.model = model
        cfg = model.config
        self.layers = list(model.model.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.max_positions = int(cfg.max_position_embeddings)
        self.max_slots = max_slots
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.slots = self.capacity = 0
        self.released = (0, 0)  # the (slots, capacity) before ``release``: rebuilt at that size
        self.generation = 0  # counts the cache's (re)allocations: a CUDA graph holds the addresses of one of them
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(min(initial_slots, max_slots), min(initial_capacity, self.max_positions))

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def release(self) -> int:
        """Drop the cache (no live request may hold a slot); returns the bytes it held. The next ``ensure``
        rebuilds it at its old size."""
        freed = self.cache_bytes()
        self.released = (max(self.released[0], self.slots), max(self.released[1], self.capacity))
        self.k, self.v, self.slots, self.capacity = [], [], 0, 0
        self.generation += 1
        return freed

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model cannot use the slot decoder (None if it can)."""
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _SLOT_MODEL_TYPES:
            return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {_SLOT_MODEL_TYPES}"
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            return "sliding-window attention layers"
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return "unexpected module layout"
        layer = inner.layers[0]
        if not all(hasattr(layer, a) for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")):
            return "unexpected decoder-layer layout"
        if not all(
            hasattr(layer.self_attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        ):
            return "unexpected attention layout"
        return None

    @torch.inference_mode()  # the cache is made of inference tensors; every write to it runs in this mode
    def ensure(self, slots: int, positions: int) -> None:
        """Room for slots ``0..slots-1`` at positions ``0..positions-1``; what was cached stays in place."""
        if positions > self.max_positions:
            raise ValueError(f"{positions} positions exceed the model's max_position_embeddings={self.max_positions}")
        if slots > self.max_slots:
            raise ValueError(f"{slots} slots exceed the cache's max_slots={self.max_slots}")
        if slots <= self.slots and positions <= self.capacity:
            return
        # a dimension that grows doubles (few copies); after a release, both come straight back to their old size
        grown_slots = max(slots, 2 * self.slots) if slots > self.slots else self.slots
        grown_capacity = max(positions, 2 * self.capacity, 64) if positions > self.capacity else self.capacity
        new_slots = min(self.max_slots, max(grown_slots, self.released[0]))
        new_capacity = min(self.max_positions, max(grown_capacity, self.released[1]))
        self.released = (0, 0)
        shape = (new_slots, self.n_kv, new_capacity, self.head_dim)
        for i in range(len(self.layers)):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.capacity:
                k[: self.slots, :, : self.capacity] = self.k[i]
                v[: self.slots, :, : self.capacity] = self.v[i]
            if i < len(self.k):
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        self.slots, self.capacity = new_slots, new_capacity
        self.generation += 1

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layers(
        self, x: torch.Tensor, position_ids: torch.Tensor, write, read_kv, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x [B, T, hidden]; ``write(i, k, v)`` stores new keys/values, ``read_kv(i, k, v)`` returns the keys and
        values to attend to; ``mask`` [B, 1, T, S] (True = attend), or None for plain causal attention."""
        cos, sin = self.model.model.rotary_emb(x, position_ids)  # [B, T, head_dim]
        cos, sin = cos[:, None], sin[:, None]
        B, T, _ = x.shape
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            write(i, k, v)
            keys, values = read_kv(i, k, v)
            o = torch.nn.functional.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scaling,
                enable_gqa=self.n_kv != self.n_heads,
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    @torch.inference_mode()
    def prefill(self, first_slot: int, prompts: list[list[int]]) -> torch.Tensor:
        """Write ``prompts`` into slots ``first_slot..first_slot+m-1``; logits at each prompt's last token [m, V].

        Work shared between prompts is done once: identical prompts (a GRPO group's first turn) are computed
        once and their cache copied, and the longest prefix common to the distinct ones (the system prompt)
        is computed once at batch 1 and copied into every slot before the rest is prefilled. Duplicates must
        come after the first occurrence of their prompt (``TorchEngine`` orders them so).
        """
        m = len(prompts)
        first_of: dict[tuple, int] = {}
        source = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]
        u = len(first_of)
        if source[:u] != list(range(u)):
            raise ValueError("prefill: every distinct prompt must appear before its duplicates")
        distinct = prompts[:u]
        self.ensure(first_slot + m, max(len(p) for p in distinct) + 1)
        shared = 0
        if u > 1:
            shortest = min(len(p) for p in distinct)
            while shared < shortest - 1 and all(p[shared] == distinct[0][shared] for p in distinct):
                shared += 1
            if shared < self.min_shared_prefix:
                shared = 0
        if shared:
            self._extend(first_slot, [distinct[0][:shared]], 0)
            for r in range(1, u):
                self.move_slot(first_slot, first_slot + r, shared)
        logits = self._extend(first_slot, [p[shared:] for p in distinct], shared)
        for r in range(u, m):
            self.move_slot(first_slot + source[r], first_slot + r, len(prompts[r]))
        return logits[source]

    min_shared_prefix = 8  # shorter common prefixes are not worth the extra batch-1 pass

    def _extend(self, first_slot: int, chunks: list[list[int]], start: int) -> torch.Tensor:
        """Append ``chunks`` (right-padded) at cache positions ``start..`` of slots ``first_slot..``, whose
        positions ``< start`` already hold their keys and values; logits at each chunk's last token [B, V]."""
        B, T = len(chunks), max(len(c) for c in chunks)
        ids = torch.zeros((B, T), dtype=torch.long, device="cpu")  # built on the CPU, moved once
        for r, c in enumerate(chunks):
            ids[r, : len(c)] = torch.tensor(c, dtype=torch.long, device="cpu")
        ids = ids.to(self.device)
        lengths = torch.tensor([len(c) for c in chunks], device=self.device)
        slots = slice(first_slot, first_slot + B)
        q_pos = torch.arange(T, device=self.device)
        if start == 0:
            # Causal attention alone is exact: with right padding, a key past a row's own tokens is only
            # visible to query positions past them too, whose outputs are never read (decode overwrites
            # those cache entries before any real query attends to them).
            mask = None
        else:  # every query sees the whole cached prefix, then the chunk causally (same argument for padding)
            k_pos = torch.arange(start + T, device=self.device)
            mask = ((k_pos[None, :] < start) | (k_pos[None, :] - start <= q_pos[:, None]))[None, None]

        def write(i, k, v):
            self.k[i][slots, :, start : start + T] = k
            self.v[i][slots, :, start : start + T] = v

        def read(i, k, v):
            if start == 0:
                return k, v
            return self.k[i][slots, :, : start + T], self.v[i][slots, :, : start + T]

        x = self.model.model.embed_tokens(ids)
        hidden = self._layers(x, (start + q_pos)[None].expand(B, T), write, read, mask)
        return self._logits(hidden[torch.arange(B, device=self.device), lengths - 1])

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of slots ``0..n-1`` at ``positions``; next-token logits [n, V]."""
        n = len(tokens)
        span = max(positions) + 1
        self.ensure(n, span)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        rows = torch.arange(n, device=self.device)
        mask = (torch.arange(span, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]

        def write(i, k, v):
            self.k[i][rows, :, pos] = k[:, :, 0]
            self.v[i][rows, :, pos] = v[:, :, 0]

        def read(i, k, v):
            return self.k[i][:n, :, :span], self.v[i][:n, :, :span]

        x = self.model.model.embed_tokens(ids)
        hidden = self._layers(x, pos[:, None], write, read, mask)
        return self._logits(hidden[:, -1])

    def static_decode(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``decode`` with shapes that depend only on the batch and the cache's capacity, so that a CUDA graph can
        replay it: ids [b, 1] and pos [b] (device tensors) for slots 0..b-1, attention over the whole capacity under
        a mask. Rows past the live requests are padding: they write position ``pos`` of free slots, which a
        prefill overwrites before anything reads it. Logits [b, V]."""
        b = ids.shape[0]
        rows = torch.arange(b, device=self.device)
        mask = (torch.arange(self.capacity, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]

        def write(i, k, v):
            self.k[i][rows, :, pos] = k[:, :, 0]
            self.v[i][rows, :, pos] = v[:, :, 0]

        def read(i, k, v):
            return self.k[i][:b], self.v[i][:b]

        x = self.model.model.embed_tokens(ids)
        hidden = self._layers(x, pos[:, None], write, read, mask)
        return self._logits(hidden[:, -1])


def batch_bucket(n: int, max_slots: int) -> int:
    """The padded batch of a static decode step: the next power of two, at most ``max_slots`` (few shapes, so few
    graphs; at most 2x the rows)."""
    return min(max_slots, 1 << max(0, n - 1).bit_length())


class StaticDecoder:
    """The decode step at fixed shapes (``SlotDecoder.static_decode``), batches padded to ``batch_bucket``; with
    ``graphs`` (CUDA), each shape captured once as a CUDA graph and replayed, so that a step costs the GPU's time
    rather than one Python dispatch and kernel launch per operation. A graph holds the cache's addresses: the
    graphs go when the cache is reallocated (it grew, or was released)."""

    def __init__(self, decoder: SlotDecoder, graphs: bool):
        self.decoder, self.use_graphs = decoder, graphs
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, ids, pos, logits), for the cache generation below
        self._generation = -1
        self._pool = None

    @torch.inference_mode()
    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        d = self.decoder
        n = len(tokens)
        b = batch_bucket(n, d.max_slots)
        d.ensure(b, max(positions) + 1)  # padding rows write to free slots below b
        ids = torch.zeros((b, 1), dtype=torch.long, device="cpu")
        pos = torch.zeros(b, dtype=torch.long, device="cpu")
        ids[:n, 0] = torch.tensor(tokens, dtype=torch.long)
        pos[:n] = torch.tensor(positions, dtype=torch.long)
        if not self.use_graphs:
            return d.static_decode(ids.to(d.device), pos.to(d.device))[:n]
        if d.generation != self._generation:
            self._graphs.clear()
            self._generation = d.generation
        if b not in self._graphs:
            try:
                self._graphs[b] = self._capture(b)
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured still runs, uncaptured
                log.warning(
                    "CUDA graph capture failed (%s: %s); the static decode step runs uncaptured",
                    type(exc).__name__,
                    exc,
                )
                self.use_graphs = False
                self._graphs.clear()
                return d.static_decode(ids.to(d.device), pos.to(d.device))[:n]
        graph, g_ids, g_pos, g_logits = self._graphs[b]
        g_ids.copy_(ids)
        g_pos.copy_(pos)
        graph.replay()
        return g_logits[:n]

    def _capture(self, b: int) -> tuple:
        """Capture ``static_decode`` at batch ``b``. The warm-up runs for real (a graph records what ran once on its
        stream), writing position 0 of slots 0..b-1: those entries are put back afterwards."""
        d = self.decoder
        ids = torch.zeros((b, 1), dtype=torch.long, device=d.device)
        pos = torch.zeros(b, dtype=torch.long, device=d.device)
        saved = [(k[:b, :, 0].clone(), v[:b, :, 0].clone()) for k, v in zip(d.k, d.v)]
        try:
            side = torch.cuda.Stream(d.device)
            side.wait_stream(torch.cuda.current_stream(d.device))
            with torch.cuda.stream(side):
                d.static_decode(ids, pos)
            torch.cuda.current_stream(d.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = d.static_decode(ids, pos)
        finally:
            for (k, v), (sk, sv) in zip(zip(d.k, d.v), saved):
                k[:b, :, 0] = sk
                v[:b, :, 0] = sv
        return graph, ids, pos, logits


class _Request:
    __slots__ = ("prompt", "params", "tokens", "logprobs", "entropies", "result", "error")

    def __init__(self, prompt: list[int], params: SamplingParams):
        self.prompt, self.params = prompt, params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return self.result is None and self.error is None

    @property
    def position(self) -> int:
        """Cache position of the newest sampled token (written by the next decode step); also the number
        of positions already in the cache."""
        return len(self.prompt) + len(self.tokens) - 1


DECODE_FORMS = ("dynamic", "static", "graphs")


class TorchEngine(InferenceEngine):
    name = "torch"

    def __init__(
        self,
        model,
        tokenizer,
        max_batch_size: int = 64,
        device: str | torch.device | None = None,
        prefill_token_budget: int = 16384,
        kv_initial_capacity: int = 256,
        decode: str = "auto",
        kv_initial_slots: int = 8,
    ):
        """``device``: where the model runs (None: where it already is). Every tensor a step creates, and the
        sampling generators, live there too. ``decode``: the decode step's form (``rollout.torch_decode``):
        dynamic (shapes follow the live requests), static (``StaticDecoder``: padded, fixed shapes), graphs
        (static, replayed as CUDA graphs; CUDA only), auto (graphs on CUDA, else dynamic). ``kv_initial_slots`` x
        ``kv_initial_capacity``: the KV cache's first size, which grows with the live requests (``SlotDecoder``)."""
        super().__init__()
        self.model = (model.to(device) if device is not None else model).eval()
        # the parameters' device, which names its index ("cuda" becomes "cuda:0"): the generators and every tensor a
        # step creates are compared with the logits' device, and torch.device("cuda") != torch.device("cuda:0")
        self.device = next(self.model.parameters()).device
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_token_budget = prefill_token_budget
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id
        self.fallback_reason = SlotDecoder.unsupported(self.model)
        self.decoder = (
            SlotDecoder(self.model, max_batch_size, kv_initial_capacity, kv_initial_slots)
            if self.fallback_reason is None
            else None
        )
        if decode == "auto":
            decode = "graphs" if self.device.type == "cuda" else "dynamic"
        if decode not in DECODE_FORMS:
            raise ValueError(f"decode={decode!r} is not one of {DECODE_FORMS}")
        if decode == "graphs" and self.device.type != "cuda":
            raise ValueError(f"decode='graphs' needs a CUDA device; the model is on {self.device}")
        self.decode_form = decode if self.decoder is not None else "generic"
        self._decode_step = (
            StaticDecoder(self.decoder, graphs=decode == "graphs")
            if self.decoder is not None and decode != "dynamic"
            else (self.decoder.decode if self.decoder is not None else None)
        )
        self._waiting: deque[_Request] = deque()
        self._live: list[_Request] = []  # _live[s] occupies cache slot s
        self._admitting: list[_Request] = []
        self._queue_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._gen = make_generator(self.device)  # unseeded calls continue a stream drawn from torch's global RNG
        # statistics: decode steps, rows they decoded (mean batch = rows / steps), and requests admitted
        # while others were mid-decode
        self.decode_steps = 0
        self.decode_rows = 0
        self.admitted_mid_decode = 0

    @property
    def continuous_batching(self) -> bool:
        return self.decoder is not None

    # ------------------------------------------------------------ weights

    def load_weights(self, state_dict: dict, version: int) -> None:
        own = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"load_weights: unknown parameter names {unknown[:5]}")
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = sorted(set(own) - set(state_dict) - tied)
        if missing:
            raise KeyError(f"load_weights: state dict lacks {missing[:5]}")
        with self._step_lock, torch.no_grad():  # never between two decode steps of a live request
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].dtype))
            self.version = int(version)

    def release_memory(self) -> int:
        """Free the slot decoder's KV cache between rollouts (colocated mode: the learner on the same device updates
        meanwhile); on CUDA the allocator's cached blocks go back to the device too, so that another process (the
        learner) can use them. Nothing is freed while a request is live. Returns the bytes freed."""
        if self.decoder is None:
            return 0
        with self._step_lock, self._queue_lock:
            if self._live or self._waiting or self._admitting:
                return 0
            freed = self.decoder.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    # ------------------------------------------------------------ generation

    def generate(self, prompts, params):
        per = self._per_prompt(params, len(prompts))
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        if self.decoder is None:
            return self._generate_padded(prompts, per)
        for i, p in enumerate(prompts):
            if len(p) >= self.decoder.max_positions:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the model's window is {self.decoder.max_positions}")
        reqs = [_Request(list(p), sp) for p, sp in zip(prompts, per)]
        with self._queue_lock:
            if per and per[0].seed is not None:
                # Reproducible for one caller; concurrent callers share the generator by design.
                self._gen.manual_seed(per[0].seed)
            self._waiting.extend(reqs)
        while any(r.pending for r in reqs):
            with self._step_lock:  # the holder steps every live request, its own and other callers'
                if any(r.pending for r in reqs):
                    try:
                        self._step()
                    except BaseException as exc:
                        self._fail_all(exc)
        failed = next((r.error for r in reqs if r.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"generation failed: {type(failed).__name__}: {failed}") from failed
        return [r.result for r in reqs]

    def _fail_all(self, exc: BaseException) -> None:
        """A failed step fails every request in flight (each caller raises); the engine stays usable."""
        with self._queue_lock:
            doomed = self._live + self._admitting + list(self._waiting)
            self._waiting.clear()
        for r in doomed:
            if r.pending:
                r.error = exc
        self._live, self._admitting = [], []

    @torch.inference_mode()
    def _step(self) -> None:
        """Decode one token for every live request, then admit waiting requests into free slots."""
        if self._live:
            logits = self._decode_step([r.tokens[-1] for r in self._live], [r.position for r in self._live])
            self.decode_steps += 1
            self.decode_rows += len(self._live)
            self._consume(self._live, logits)
            self._release_finished()
        with self._queue_lock:
            free = self.max_batch_size - len(self._live)
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            self._admitting = admitted  # neither waiting nor live until prefilled: _fail_all must see them
        if not admitted:
            return
        if self._live:
            self.admitted_mid_decode += len(admitted)
        admitted.sort(key=lambda r: len(r.prompt))  # similar lengths share a prefill chunk: little padding
        chunks, cur = [], []
        for r in admitted:
            if cur and (len(cur) + 1) * len(r.prompt) > self.prefill_token_budget:
                chunks.append(cur)
                cur = []
            cur.append(r)
        chunks.append(cur)
        for chunk in chunks:
            seen: set[tuple] = set()  # first occurrences of each prompt, then duplicates (prefill's contract)
            firsts, dups = [], []
            for r in chunk:
                (dups if tuple(r.prompt) in seen else firsts).append(r)
                seen.add(tuple(r.prompt))
            chunk = firsts + dups
            first = len(self._live)
            self._live.extend(chunk)
            logits = self.decoder.prefill(first, [r.prompt for r in chunk])
            self._consume(chunk, logits)
        self._admitting = []
        self._release_finished()

    def _consume(self, reqs: list[_Request], logits: torch.Tensor, gen: torch.Generator | None = None) -> None:
        """Sample one token per request from its logits row (with ``gen``, else the engine's generator) and
        record it; finished requests get a result. Both the slot and the generic path end every step here."""
        logits = logits.float()
        logp_full = torch.log_softmax(logits, dim=-1)
        entropy = -(logp_full.exp() * logp_full).sum(-1)
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32, device=logits.device)
        top_ps = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32, device=logits.device)
        token = sample_tokens(logits, temps, top_ps, gen or self._gen)
        chosen = logp_full.gather(-1, token[:, None])[:, 0]
        for r, t, lp, h in zip(reqs, token.tolist(), chosen.tolist(), entropy.tolist()):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.entropies.append(h)
            reason = self._stop_reason(r.tokens, r.params)
            if reason is not None:
                self._finish(r, "stop", reason)
            elif len(r.tokens) >= r.params.max_new_tokens or (
                self.decoder is not None and r.position >= self.decoder.max_positions
            ):
                self._finish(r, "length", None)

    @staticmethod
    def _finish(r: _Request, reason: str, stop) -> None:
        r.result = GenerationResult(r.tokens, r.logprobs, r.entropies, reason, stop, entropy_is_estimate=False)

    def _release_finished(self) -> None:
        """Drop finished requests and close the holes they leave, so live requests stay in slots 0..n-1."""
        live = self._live
        n = sum(r.result is None for r in live)
        holes = [s for s in range(n) if live[s].result is not None]
        movers = [s for s in range(n, len(live)) if live[s].result is None]
        for hole, src in zip(holes, movers):
            self.decoder.move_slot(src, hole, live[src].position)
            live[hole] = live[src]
        del live[n:]

    # ------------------------------------------------------------ generic path (any causal LM)

    def _generate_padded(self, prompts, per):
        results: list[GenerationResult | None] = [None] * len(prompts)
        # Sort by length so batches pad little; results go back to their original positions.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.max_batch_size):
            idx = order[start : start + self.max_batch_size]
            for i, res in zip(idx, self._generate_batch([prompts[i] for i in idx], [per[i] for i in idx])):
                results[i] = res
        return results

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
        from transformers import DynamicCache

        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long, device="cpu")  # built on the CPU, moved once
        attn = torch.zeros((B, L), dtype=torch.long, device="cpu")
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long, device="cpu")
            attn[i, L - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
        ).logits[:, -1, :]

        gen = make_generator(self.device, params[0].seed)
        reqs = [_Request(list(p), sp) for p, sp in zip(prompts, params)]
        active = list(range(B))  # request of each live cache row
        next_pos = pos[:, -1] + 1

        while True:
            self._consume([reqs[row] for row in active], logits, gen)
            keep = [r for r, row in enumerate(active) if reqs[row].pending]
            if not keep:
                break
            if len(keep) < len(active):
                cache.batch_select_indices(torch.tensor(keep, device=self.device))
                attn, next_pos = attn[keep], next_pos[keep]
                active = [active[r] for r in keep]
            token = torch.tensor([reqs[row].tokens[-1] for row in active], dtype=torch.long, device=self.device)
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype, device=self.device)], dim=1)
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_pos = next_pos + 1

        return [r.result for r in reqs]

    def _stop_reason(self, tokens: list[int], p: SamplingParams):
        last = tokens[-1]
        if last in p.stop_token_ids:
            return last
        if self.eos_id is not None and last == self.eos_id and not p.ignore_eos:
            return last
        if p.stop_strings:
            # Decode only a short tail: a stop string must end inside the last token to stop here.
            tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=False)
            last = self.tokenizer.decode(tokens[-1:], skip_special_tokens=False)
            return stop_string_at(tail, last, p.stop_strings)
        return None


def sample_tokens(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """One token per row: greedy where ``temps`` is 0, else temperature + nucleus (top-p) sampling.

    logits [B, V] float; temps, top_ps [B] on the logits' device; ``gen`` on the logits' device too (CUDA's
    multinomial rejects a CPU generator). Returns token ids [B] (long, same device).
    """
    for name, t in (("temps", temps), ("top_ps", top_ps)):
        if t.device != logits.device:
            raise ValueError(f"sample_tokens: {name} is on {t.device}, the logits on {logits.device}")
    if gen.device != logits.device:
        raise ValueError(f"sample_tokens: the generator is on {gen.device}, the logits on {logits.device}")
    greedy = logits.argmax(-1)
    if bool((temps == 0).all()):
        return greedy
    scaled = logits / temps.clamp(min=1e-6)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_ps < 1).any()):
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_ps[:, None]  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, sorted_i, sorted_p)
    sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return torch.where(temps == 0, greedy, sampled)
