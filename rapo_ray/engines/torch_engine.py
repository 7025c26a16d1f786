"""Torch inference engine: batched KV-cache sampling on any HF causal LM, exact logprobs and entropies.

The fallback where vLLM does not install, and the fast path for unit tests. Prompts are left-padded into
batches of at most ``max_batch_size``; each decode step runs only the rows still generating (finished rows
are evicted from the KV cache, so a batch does not pay for its longest member's tail).
"""

from __future__ import annotations

import torch

from rapo_ray.engines.base import GenerationResult, InferenceEngine, SamplingParams


class TorchEngine(InferenceEngine):
    name = "torch"

    def __init__(self, model, tokenizer, max_batch_size: int = 64, device: str = "cpu"):
        super().__init__()
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id

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
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].dtype))
        self.version = int(version)

    # ------------------------------------------------------------ generation

    def generate(self, prompts, params):
        per = self._per_prompt(params, len(prompts))
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
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
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, L - len(p) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1, :]

        gen = torch.Generator(device="cpu")
        seed = params[0].seed
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        out_tokens: list[list[int]] = [[] for _ in range(B)]
        out_logp: list[list[float]] = [[] for _ in range(B)]
        out_ent: list[list[float]] = [[] for _ in range(B)]
        finish: list[tuple[str, object] | None] = [None] * B
        active = list(range(B))  # original row of each live cache row
        next_pos = pos[:, -1] + 1

        while active:
            logits = logits.float()
            logp_full = torch.log_softmax(logits, dim=-1)
            entropy = -(logp_full.exp() * logp_full).sum(-1)
            token = self._sample(logits, temps[active], top_ps[active], gen)
            chosen_logp = logp_full.gather(-1, token[:, None])[:, 0]
            keep = []
            for r, row in enumerate(active):
                t = int(token[r])
                out_tokens[row].append(t)
                out_logp[row].append(float(chosen_logp[r]))
                out_ent[row].append(float(entropy[r]))
                reason = self._stop_reason(out_tokens[row], params[row])
                if reason is not None:
                    finish[row] = ("stop", reason)
                elif len(out_tokens[row]) >= params[row].max_new_tokens:
                    finish[row] = ("length", None)
                else:
                    keep.append(r)
            if not keep:
                break
            if len(keep) < len(active):
                cache.batch_select_indices(torch.tensor(keep, device=self.device))
                attn, next_pos, token = attn[keep], next_pos[keep], token[keep]
                active = [active[r] for r in keep]
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype, device=self.device)], dim=1)
            logits = self.model(
                input_ids=token[:, None].to(self.device),
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_pos = next_pos + 1

        return [
            GenerationResult(out_tokens[i], out_logp[i], out_ent[i], finish[i][0], finish[i][1], entropy_is_estimate=False)
            for i in range(B)
        ]

    @staticmethod
    def _sample(logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
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

    def _stop_reason(self, tokens: list[int], p: SamplingParams):
        last = tokens[-1]
        if last in p.stop_token_ids:
            return last
        if self.eos_id is not None and last == self.eos_id and not p.ignore_eos:
            return last
        if p.stop_strings:
            # Decode only a short tail: a stop string must end at the last token to stop here.
            tail = self.tokenizer.decode(tokens[-16:], skip_special_tokens=False)
            for s in p.stop_strings:
                if tail.endswith(s):
                    return s
        return None
