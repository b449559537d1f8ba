#!/bin/bash
# Issue 43's GPU checks on ONE H200 (~6 min, eager servers): a server killed mid-run and restarted (test_faults_ipc.py
# 4, both victims; 5, the re-push measured against its control) and a trainer killed inside an update (2, 3: the next
# trainer repairs the server). Results: OUT/*.json, OUT/pytest.log, OUT/failures.txt, OUT/serve_*.log.
# Usage (from the project root, after `source .gpu/setup.sh`):  bash tests/gpu/run_issue43.sh OUT [pytest -k expr]
set -u
OUT=$(realpath -m "${1:-/tmp/issue43}")
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export GPU_RESULTS_DIR=$OUT VLLM_TEST_TINY_DIR=${VLLM_TEST_TINY_DIR:-/tmp/tiny-models} VLLM_TEST_EAGER=${VLLM_TEST_EAGER:-1}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
PY=${PYTHON:-python3}
T0=$(date +%s)
if [ ! -f "$VLLM_TEST_TINY_DIR/tiny-dsv2/config.json" ]; then
  timeout 180 $PY tests/gpu/make_tiny_models.py "$VLLM_TEST_TINY_DIR" --tokenizer /tmp/smol > "$OUT/make_tiny_models.log" 2>&1
fi
echo "models ready after $(( $(date +%s) - T0 )) s"
timeout -s INT -k 30 "${ISSUE43_TIMEOUT:-520}" $PY -m pytest -v -rA -p no:cacheprovider --junitxml "$OUT/junit.xml" \
  tests/gpu/test_faults_ipc.py -k "${2:-test_5 or test_4 or test_2 or test_3}" 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " | cut -c1-400
echo "pytest rc ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
