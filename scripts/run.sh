#!/usr/bin/env bash
# Installs fla-falcon into ./.venv and runs the main job: the variable-length addition evaluation
# (evals/addition). With no arguments it runs the `tiny` preset, a CPU smoke test of every model
# (about 6-9 minutes on 2 cores); pass `--preset paper` on a GPU machine for the paper's protocol,
# `--help` for every option.
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
if [ "$#" -eq 0 ]; then set -- --preset tiny; fi
fla-falcon-addition "$@"
