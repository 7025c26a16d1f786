"""all-MiniLM-L6-v2 through ONNX Runtime with int8 weights (``retrieval.embedder=minilm-onnx-int8``).

The graph is exported here, once, from the packaged MiniLM: it is ``Embedder.forward_tensors`` itself (the same
position ids, the same last-position-only last layer, the same pooling and normalisation), so the two embedders
differ only in arithmetic. Its MatMul weights are then quantized to int8 by ONNX Runtime's dynamic quantization, one
scale per output channel (one scale per tensor moved last-token vectors much further from fp32's). The result is
cached under ``run.artifacts_dir/embedders/`` in a folder named by what it was made from (the MiniLM weights, the
pooling, the torch and onnxruntime versions, ``EXPORT_VERSION``), written to a temporary folder and renamed, so a
crash never leaves half a model and any change of inputs exports again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from rapo_ray.core.files import file_sha256, write_json_atomic
from rapo_ray.retrieval.embedder import Embedder, minilm_path

EXPORT_VERSION = 1  # bump when the export or quantization changes the vectors
MODEL_FILE = "model-int8.onnx"
INPUTS = ("input_ids", "attention_mask", "position_ids")


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise RuntimeError(
            "retrieval.embedder=minilm-onnx-int8 needs onnxruntime and onnx (pip install -e '.[cpu]' installs both)"
        ) from exc
    return onnxruntime


def export_fingerprint(pooling: str) -> dict:
    """What the exported model's vectors depend on."""
    weights = sorted(minilm_path().glob("*.safetensors")) or sorted(minilm_path().glob("*.bin"))
    return {
        "minilm": hashlib.sha256("".join(file_sha256(f) for f in weights).encode()).hexdigest()[:16],
        "pooling": pooling,
        "torch": torch.__version__,
        "onnxruntime": _onnxruntime().__version__,
        "export_version": EXPORT_VERSION,
    }


class _Graph(torch.nn.Module):
    def __init__(self, embedder: Embedder):
        super().__init__()
        self.embedder = embedder
        self.model = embedder.model  # registered, so the exporter sees the weights as parameters
        self.last_layer = embedder._last_layer

    def forward(self, input_ids, attention_mask, position_ids):
        return self.embedder.forward_tensors(input_ids, attention_mask, position_ids)


def onnx_minilm(artifacts_dir: str | Path, pooling: str = "last") -> Path:
    """The int8 MiniLM model file for ``pooling``, exported and quantized under ``artifacts_dir`` on first use."""
    _onnxruntime()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fingerprint = export_fingerprint(pooling)
    key = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(artifacts_dir) / "embedders" / f"minilm-onnx-int8-{key}"
    if (folder / MODEL_FILE).is_file():
        return folder / MODEL_FILE
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    graph = _Graph(Embedder(pooling=pooling, cache_size=0)).eval()
    example = torch.ones((2, 8), dtype=torch.int64)
    positions = torch.arange(8).expand(2, 8).contiguous()
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice, on every export
        torch.onnx.export(
            graph,
            (example, example, positions),
            str(tmp / "model-fp32.onnx"),
            input_names=list(INPUTS),
            output_names=["vectors"],
            dynamic_axes={**{name: {0: "batch", 1: "tokens"} for name in INPUTS}, "vectors": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    quantize_dynamic(str(tmp / "model-fp32.onnx"), str(tmp / MODEL_FILE), weight_type=QuantType.QInt8, per_channel=True)
    (tmp / "model-fp32.onnx").unlink()
    write_json_atomic(tmp / "built_from.json", fingerprint)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder / MODEL_FILE


class OnnxEmbedder(Embedder):
    """``Embedder`` (same cut, tokenization and cache) whose vectors come from an ONNX Runtime session over
    ``model_file`` (``onnx_minilm``), on the CPU with ``threads`` intra-op threads.

    One text per session run: dynamic quantization scales each activation tensor by its own range, so in a padded
    batch a text's vector would depend on the texts beside it (and a query would get other neighbours depending on
    what it was batched with). Unpadded single texts were also the fastest on a 2-core CPU (docs/RESULTS.md)."""

    def __init__(self, model_file: str | Path, threads: int = 1, **embedder_kwargs):
        if not Path(model_file).is_file():
            raise FileNotFoundError(f"ONNX embedder model {model_file} does not exist (onnx_minilm builds it)")
        self.model_file, self.threads = Path(model_file), threads
        built = self.model_file.parent / "built_from.json"
        pooling = embedder_kwargs.get("pooling", "last")
        if built.is_file() and json.loads(built.read_text()).get("pooling") != pooling:
            raise ValueError(
                f"{model_file} was exported for pooling {json.loads(built.read_text())['pooling']!r}, not {pooling!r}"
            )
        super().__init__(device="cpu", batch_size=1, **embedder_kwargs)

    def _load_model(self, path: Path, last_position_only: bool) -> None:
        ort = _onnxruntime()
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.model_file), options, providers=["CPUExecutionProvider"])
        self.dim = int(self.session.get_outputs()[0].shape[-1])
        self._last_layer = None

    def batch_vectors(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        feeds = dict(zip(INPUTS, (input_ids, attention_mask, position_ids)))
        return self.session.run(None, feeds)[0].astype(np.float32, copy=False)


__all__ = ["EXPORT_VERSION", "OnnxEmbedder", "export_fingerprint", "onnx_minilm"]
