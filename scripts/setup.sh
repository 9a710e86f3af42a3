#!/usr/bin/env bash
# Set up .venv with fxpipe, its test extra, the Hugging Face extra and the datasets extra.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first, pinned: on a CPU machine pip takes the local CPU build of 2.13.0; an
# unpinned `torch` could pull a multi-GB CUDA build. GPU machines get CUDA's build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
# transformers is pinned exactly by pyproject's `hf` extra (the release the compatibility
# matrix was generated with); a venv holding another release is brought to it.
TRANSFORMERS=$(sed -n 's/^hf = \["transformers==\([0-9.]*\)"\]$/\1/p' pyproject.toml)
[ -n "$TRANSFORMERS" ] || { echo "setup.sh: pyproject.toml's hf extra must pin transformers==X.Y.Z" >&2; exit 1; }
if ! .venv/bin/python -c "import fxpipe, pytest, xdist, hypothesis, transformers, importlinter, grimp, datasets, tensorboard
assert transformers.__version__ == '$TRANSFORMERS'" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test,hf,data]"
fi
