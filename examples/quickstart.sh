#!/usr/bin/env bash
# Command 1 of the README: install what is needed, then run the whole workflow (see quickstart.py).
#   bash examples/quickstart.sh                        # CPU, 2 processes
#   bash examples/quickstart.sh --device-backend cuda  # GPUs
#   bash examples/quickstart.sh --quick                # a short run
# It installs into a virtual environment: the active one, $PYTHON's, or else .venv/ in this checkout
# (created on the first run). The first run spends most of its time installing (torch, the Hugging Face
# extras: a few minutes on a fresh machine); later runs reuse the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
  PY=python3  # the active environment's
else
  if [ ! -x .venv/bin/python ]; then
    echo "quickstart: creating the virtual environment .venv/ (set PYTHON=... to use another interpreter)"
    # the system's interpreter only creates the environment (BASE_PYTHON overrides it); everything
    # after runs the environment's own python
    BASE_PYTHON=${BASE_PYTHON:-python3}
    "$BASE_PYTHON" -m venv .venv
  fi
  PY=.venv/bin/python
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  # No torch yet: the CPU build (a CUDA machine brings its own torch).
  echo "quickstart: installing torch and mcore into $("$PY" -c 'import sys; print(sys.prefix)') (the first run's longest step)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
# mcore from this checkout with the extras the workflow uses; skipped when the environment already has
# them (a later run, or after the README's `pip install -e .`): redone for an install of another
# checkout, or one older than pyproject.toml/setup.py.
if ! "$PY" -I - 2>/dev/null <<'CHECK'
import importlib.metadata as md, importlib.util as iu, pathlib, sys
extras = ("accelerate", "matplotlib", "safetensors", "tensorboard", "tokenizers", "transformers")
if any(iu.find_spec(name) is None for name in extras): sys.exit(1)
root, mcore = pathlib.Path.cwd().resolve(), iu.find_spec("mcore")
dist = md.distribution("mcore-train")
meta = next(f for f in dist.files if f.name == "METADATA")
fresh = dist.locate_file(meta).stat().st_mtime >= max((root / n).stat().st_mtime for n in ("pyproject.toml", "setup.py"))
sys.exit(0 if mcore and root in pathlib.Path(mcore.origin).resolve().parents and fresh else 1)
CHECK
then
  "$PY" -m pip install -q -e ".[hf,logging]" matplotlib
fi
exec "$PY" examples/quickstart.py "$@"
