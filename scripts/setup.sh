#!/usr/bin/env bash
# Set up .venv with fxpipe, its test extra, the Hugging Face extra and the datasets extra.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The installs go through uv when pip can fetch it (a fresh setup in 41 s instead of 75 s on
# the CI machine: pip spends 26 s unpacking torch alone); pip does them where it cannot.
UV=
find_uv() {  # uv's path, fetched once with pip ("none" where pip cannot fetch it)
  if [ -z "$UV" ]; then
    if [ -x .venv/bin/uv ] || .venv/bin/pip install -q --disable-pip-version-check uv 2>/dev/null; then
      UV=.venv/bin/uv
    else
      UV=none
    fi
  fi
}
install() {
  find_uv
  if [ "$UV" != none ]; then
    "$UV" pip install -q --compile-bytecode --python .venv/bin/python "$@"
  else
    .venv/bin/pip install -q --disable-pip-version-check "$@"
  fi
}
# torch first, pinned: on a CPU machine the CPU build of 2.13.0 lies in /opt/wheels (pip
# is pointed there by the machine's config; uv is told here); an unpinned `torch` could
# pull a multi-GB CUDA build. GPU machines get CUDA's build from the index.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -d /opt/wheels ]; then
    install --find-links /opt/wheels torch==2.13.0
  else
    install torch==2.13.0
  fi
fi
# transformers is pinned exactly by pyproject's `hf` extra (the release the compatibility
# matrix was generated with); a venv holding another release is brought to it. The torch
# installed above satisfies the project's range, so this step leaves it alone.
TRANSFORMERS=$(sed -n 's/^hf = \["transformers==\([0-9.]*\)"\]$/\1/p' pyproject.toml)
[ -n "$TRANSFORMERS" ] || { echo "setup.sh: pyproject.toml's hf extra must pin transformers==X.Y.Z" >&2; exit 1; }
if ! .venv/bin/python -c "import fxpipe, pytest, xdist, hypothesis, transformers, importlinter, grimp, datasets, tensorboard
assert transformers.__version__ == '$TRANSFORMERS'" 2>/dev/null; then
  install -e ".[test,hf,data]"
fi
