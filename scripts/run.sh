#!/usr/bin/env bash
# Installs fla-falcon into ./.venv and runs the main job: the variable-length addition evaluation
# (evals/addition). With no arguments it runs the `tiny` preset, a CPU smoke test of every model
# (about 7-9 minutes on 2 cores); pass `--preset paper` on a GPU machine for the paper's protocol,
# `--help` for every option.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# the CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build
python -m pip show torch >/dev/null 2>&1 || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
if [ "$#" -eq 0 ]; then set -- --preset tiny; fi
fla-falcon-addition "$@"
