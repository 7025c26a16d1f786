"""Model and tokenizer factory: build the bundled small Qwen2 and its BPE tokenizer, save/load HF folders.

Any local Hugging Face causal-LM folder (a Qwen2.5-3B-Instruct on a GPU cluster, say) loads through
``load_model`` / ``load_tokenizer`` as well. Tokenizers are loaded with ``PreTrainedTokenizerFast`` because
in transformers 5 ``AutoTokenizer`` on a qwen2-typed folder encodes differently from its tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import torch

from rapo_ray.core.errors import ModelLoadError
from rapo_ray.core.transformers_import_cache import cache_transformers_import_scans
from rapo_ray.envs import tasks
from rapo_ray.model.gguf import ensure_converted, packaged_gguf
from rapo_ray.model.light_imports import hide_unused_packages_from_transformers
from rapo_ray.types import protocol

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_torch_threads(n: int = 1) -> None:
    """One intra-op thread per process unless configured: on a busy small box, more threads than cores spin and wait
    for each other, many times slower."""
    n = int(os.environ.get("RAPO_TORCH_THREADS", n))
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE trained on ``texts``; every protocol tag and chat-frame marker is one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cache_transformers_import_scans()
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=protocol.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=protocol.BOS,
        eos_token=protocol.EOS,
        pad_token=protocol.PAD,
        additional_special_tokens=[
            t for t in protocol.SPECIAL_TOKENS if t not in (protocol.BOS, protocol.EOS, protocol.PAD)
        ],
    )


def load_tokenizer(path: str | Path):
    cache_transformers_import_scans()  # a driver's first transformers import is often this one
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise ModelLoadError(f"tokenizer folder {p} has no tokenizer.json (missing or not a tokenizer folder)")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {p}: {type(exc).__name__}: {exc}") from exc
    if tok.pad_token_id is None:  # many instruct checkpoints ship without one
        tok.pad_token = tok.eos_token
    return tok


# ---------------------------------------------------------------- model


def build_model(model_cfg, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    """A randomly initialised Qwen2ForCausalLM of the configured size."""
    hide_unused_packages_from_transformers()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    torch.manual_seed(model_cfg.seed)
    config = Qwen2Config(
        vocab_size=max(vocab_size, model_cfg.min_vocab),
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rope_theta=10000.0,
        torch_dtype=model_cfg.dtype,
    )
    model = Qwen2ForCausalLM(config)
    return model.to(_DTYPES[model_cfg.dtype]).eval()


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32"):
    """(model, tokenizer) of an HF folder: the loader ``rapo_ray.engines.make_engine`` takes."""
    return load_model(path, dtype), load_tokenizer(path)


def has_weights(path: str | Path) -> bool:
    """Whether an HF folder holds weights (``*.safetensors`` or ``*.bin``), not only its config and tokenizer."""
    p = Path(path)
    return any(p.glob("*.safetensors")) or any(p.glob("*.bin"))


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load an HF causal LM folder; clear errors for a missing or corrupt folder."""
    hide_unused_packages_from_transformers()
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"model folder {p} does not exist")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model folder {p} has no config.json")
    if not has_weights(p):
        raise ModelLoadError(f"model folder {p} has no weights (*.safetensors or *.bin)")
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=_DTYPES[dtype])
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {p}: {type(exc).__name__}: {exc}") from exc
    return model.to(device).eval()


def pad_token_id(path: str | Path) -> int:
    """The id the learner pads rows with: the model config's ``pad_token_id``, else 0 (padding is never attended).
    Read from config.json itself: transformers' ``AutoConfig`` would cost the driver seconds of imports at start-up."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model folder {p} has no config.json")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {p / 'config.json'}: {type(exc).__name__}: {exc}") from exc
    pad = config.get("pad_token_id", (config.get("text_config") or {}).get("pad_token_id"))
    return int(pad or 0)


def model_from_state_dict(path: str | Path, state_dict: dict, dtype: str = "float32"):
    """The HF model of folder ``path``'s architecture holding ``state_dict`` (cast to ``dtype``), built on the meta
    device and given the tensors: no copy of the folder's own weights is loaded (at the 0.5B shape, 2 GB less at
    every checkpoint write)."""
    hide_unused_packages_from_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    cast = {k: v.to(_DTYPES[dtype]) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(cast, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(
            f"state dict does not fit {path}: missing {sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    return model.eval()


def save_model(model, tokenizer, path: str | Path) -> Path:
    """Save model + tokenizer as an HF folder, atomically (write to a temp folder, then rename)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if p.exists():
        import shutil

        old = p.with_name(p.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        p.rename(old)
        tmp.rename(p)
        shutil.rmtree(old)
    else:
        tmp.rename(p)
    return p


# ---------------------------------------------------------------- the bundled model


TOKENIZER_CORPUS_VERSION = 2  # bump when tokenizer_corpus changes, so cached bundled models are rebuilt


def tokenizer_corpus(cfg) -> list[str]:
    """Texts the bundled tokenizer is trained on: prompts and expert solutions of every bundled family."""
    texts = [protocol.SYSTEM_PROMPT, protocol.SHORT_SYSTEM_PROMPT] * 200  # frequent enough that BPE merges their words
    for fam in cfg.tasks.families:
        for split, n in (("train", min(cfg.tasks.train_size, 2000)), ("test", min(cfg.tasks.test_size, 200))):
            for prob in tasks.generate(fam, split, n, cfg.tasks.seed):
                texts.append(prob.question)
                texts.append(tasks.expert_text(prob))
    if {"multihop", "alias"} & set(cfg.tasks.families):
        texts.extend(tasks.make_world(cfg.tasks.seed).documents())
    return texts


def bundled_model_dir(cfg) -> Path:
    """Where the bundled base model for this config lives: keyed by the settings that shape it."""
    key = json.dumps(
        {
            "m": [
                cfg.model.hidden_size,
                cfg.model.num_layers,
                cfg.model.num_heads,
                cfg.model.num_kv_heads,
                cfg.model.intermediate_size,
                cfg.model.max_position_embeddings,
                cfg.model.tie_word_embeddings,
                cfg.model.dtype,
                cfg.model.seed,
                *([cfg.model.min_vocab] if cfg.model.min_vocab else []),  # (folders built before it keep their key)
            ],
            "t": [cfg.tokenizer.vocab_size, sorted(cfg.tasks.families), cfg.tasks.seed, TOKENIZER_CORPUS_VERSION],
        }
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return Path(cfg.run.artifacts_dir) / f"base-model-{digest}"


def ensure_bundled_model(cfg) -> Path:
    """Build (once) the bundled tokenizer and randomly initialised model; return the HF folder."""
    path = bundled_model_dir(cfg)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    tok = train_tokenizer(tokenizer_corpus(cfg), cfg.tokenizer.vocab_size)
    model = build_model(cfg.model, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    save_model(model, tok, path)
    return path


def resolve_model_dir(cfg, log=print) -> Path:
    """The model folder a run starts from: ``model.path`` (an HF folder, or a .gguf file converted once), the
    converted ``model.preset``, else the bundled one."""
    if cfg.model.preset:
        return ensure_converted(packaged_gguf(cfg.model.preset), cfg.run.artifacts_dir, cfg.model.preset, log=log)
    if cfg.model.path:
        p = Path(cfg.model.path).expanduser()
        if p.suffix == ".gguf":
            return ensure_converted(p, cfg.run.artifacts_dir, log=log)
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model.path={p} is not an HF model folder (no config.json) or a .gguf file")
        return p
    return ensure_bundled_model(cfg)


def resolve_checkpoint(path: str | Path) -> Path:
    """An HF model folder; a trainer checkpoint (``step-N`` with its COMPLETE marker); a run directory (its
    latest complete checkpoint); or a folder of run directories (the newest complete checkpoint in any)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"checkpoint {p}: no such directory")
    if (p / "config.json").is_file():
        if p.name.startswith("step-") and not (p / "COMPLETE").is_file():
            raise ModelLoadError(f"checkpoint {p} is incomplete (no COMPLETE marker: the run stopped while writing it)")
        return p
    runs = [p] if (p / "checkpoints").is_dir() else [d for d in p.iterdir() if (d / "checkpoints").is_dir()]
    done = [
        c
        for r in runs
        for c in (r / "checkpoints").glob("step-*")
        if (c / "COMPLETE").is_file() and (c / "config.json").is_file()
    ]
    if not done:
        raise ModelLoadError(
            f"checkpoint {p}: not an HF model folder, and no complete checkpoint (checkpoints/step-*/COMPLETE) under it"
        )
    return max(done, key=lambda c: ((c / "COMPLETE").stat().st_mtime, c.name))


def context_length(model_dir: str | Path, default: int = 2048) -> int:
    """The model's context window (``max_position_embeddings`` of its config.json)."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    return int(data.get("max_position_embeddings", default))
