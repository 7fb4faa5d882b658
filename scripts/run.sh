#!/usr/bin/env bash
# Installs fla-falcon into ./.venv and runs the main job.
# Today that is the demo: a tiny Falcon causal LM for every rule, forward + backward + generate(),
# on the CPU through Triton's interpreter or on a GPU. The addition evaluation (issue 7) replaces it
# once it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip show torch >/dev/null 2>&1 || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
fla-falcon-demo "$@"
