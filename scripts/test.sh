#!/usr/bin/env bash
# Installs fla-falcon with its test dependencies into ./.venv and runs the test suite.
# On a machine without a GPU the Triton kernels run under Triton's interpreter (set up by
# `import fla_falcon`); on a GPU machine the same command runs them compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# the CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build
python -m pip show torch >/dev/null 2>&1 || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# pytest's exit code 5 ("no tests ran") is a failure too: set -e passes it on
python -m pytest -q tests "$@"
