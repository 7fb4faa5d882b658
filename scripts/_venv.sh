# Sourced by run.sh and test.sh: creates ./.venv if needed, activates it, and installs torch
# (the CPU build unless a torch is already there: a bare `torch` requirement would pull a
# multi-GB CUDA build) and this package with the extras in $EXTRAS (e.g. "[test]").
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip show torch >/dev/null 2>&1 || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${EXTRAS:-}"
