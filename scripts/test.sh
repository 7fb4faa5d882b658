#!/usr/bin/env bash
# Installs fla-falcon with its test dependencies into ./.venv and runs the test suite.
# On a machine without a GPU the Triton kernels run under Triton's interpreter (set up by
# `import fla_falcon`); on a GPU machine the same command runs them compiled.
set -euo pipefail
EXTRAS="[test]" . "$(dirname "$0")/_venv.sh"
# the GPU machine's Triton (3.6) beside the installed one, for tests/test_compile.py: its compiler refuses some code
# that the interpreter runs, and its rules are the ones that count
[ -d .venv/triton-gpu/triton ] || python -m pip install -q --no-deps --target .venv/triton-gpu triton==3.6.0
# one pytest worker per CPU core (pytest-xdist; PYTEST_WORKERS=0 runs in this process): the interpreted
# kernels are single-threaded. pytest's exit code 5 ("no tests ran") is a failure too: set -e passes it on
python -m pytest -q -n "${PYTEST_WORKERS:-auto}" tests "$@"
