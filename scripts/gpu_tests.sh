#!/usr/bin/env bash
# The test suite on a CUDA machine, several pytest workers at once (pytest-xdist), with a line per
# test (-rA) in a log so that a run cut short still names what passed and failed.
#   bash scripts/gpu_tests.sh [LOG] [pytest args...]      e.g. bash scripts/gpu_tests.sh /tmp/gpu.log tests/test_chunk.py
# Without a package registry (our H200), source scripts/device_setup.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-gpu_tests.log}
shift || true
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'scripts/gpu_tests.sh: no CUDA GPU')" || exit 2
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n "${PYTEST_WORKERS:-8}")
# -v with xdist prints "[gwN] PASSED tests/...::name" as each test ends; the whole output goes to LOG,
# the failures and the summary to the terminal
# every failure's traceback also goes to LOG.failures as soon as it happens (tests/conftest.py)
: > "$LOG.failures"
# FLA_FALCON_TEST_CONFIGS=one: each autotuning key compiles one config of its list, not all of them (the suite is
# compile-bound; tests/one_config.py), and LOG.configs records which ran (summed up at the end)
if [[ "${FLA_FALCON_TEST_CONFIGS:-}" == one ]]; then
    : > "$LOG.configs"
    export FLA_FALCON_CONFIG_LOG=$(realpath "$LOG.configs")
fi
PYTEST_FAIL_LOG=$(realpath "$LOG.failures") python3 -m pytest -v "${XDIST[@]}" -p no:cacheprovider --timeout "${PYTEST_TIMEOUT:-600}" -rfE "${@:-tests}" 2>&1 \
    | tee "$LOG" | grep --line-buffered -E "FAILED|ERROR|[0-9]+ (passed|failed)"
rc=${PIPESTATUS[0]}
if [[ -s "${FLA_FALCON_CONFIG_LOG:-}" ]]; then
    python3 tests/one_config.py "$FLA_FALCON_CONFIG_LOG" > "$LOG.configs.md" && echo "configs run: $LOG.configs.md"
fi
exit $rc
