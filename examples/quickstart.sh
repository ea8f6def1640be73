#!/usr/bin/env bash
# Command 1 of the README: install what is needed, then run the whole workflow (see quickstart.py).
#   bash examples/quickstart.sh                        # CPU, 2 processes
#   bash examples/quickstart.sh --device-backend cuda  # GPUs
#   bash examples/quickstart.sh --quick                # a short run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" 2>/dev/null; then
  # No torch yet: the CPU build (a CUDA machine brings its own torch).
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[hf,logging]" matplotlib
exec "$PY" examples/quickstart.py "$@"
