#!/bin/bash
# The issue's GPU checks in one call (2 x H200, ~9 min): builds the tiny models, then runs, in this order,
#   real models (DeepSeek-V2-shaped): colocate (+ HEAD e895bb7's load path), colocate + sleep, server
#   faults (served: the DeepSeek-V2-shaped model): wrong model, killed after /start_weight_update, killed mid-broadcast
#   real models (Qwen3-MoE-shaped): colocate (+ e895bb7's path), colocate + sleep, server
#   tensor parallel 2 (both models)
# Each model's server boots on GPU 1 while its colocate runs use GPU 0. Results: OUT/*.json, OUT/results.json (all of
# them), OUT/pytest.log, OUT/serve_*.log.  Usage (from the project root, after `source .gpu/setup.sh`):
#   bash tests/gpu/run_issue14.sh OUT [all|dsv2|faults|qwen|tp2|qwen+tp2|faults+qwen+tp2|colocate]
# (colocate: both models' colocate tests only, with and without sleep: what a 1-GPU host can run)
# pytest gets ISSUE14_TIMEOUT s (default 520, then SIGINT: the session's server is stopped); what it cut can be run in
# a second call by naming its part.
set -u
OUT=$(realpath -m "${1:-/tmp/issue14}")
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export GPU_RESULTS_DIR=$OUT VLLM_TEST_TINY_DIR=${VLLM_TEST_TINY_DIR:-/tmp/tiny-models} VLLM_TEST_EAGER=${VLLM_TEST_EAGER:-1}
PY=${PYTHON:-python3}
export VLLM_TEST_OVERLAP=1 VLLM_TEST_RUN_TIMEOUT=${VLLM_TEST_RUN_TIMEOUT:-180} PYTHONUNBUFFERED=1
R=tests/gpu/test_real_models.py F=tests/gpu/test_faults.py
DSV2=("$R::test_colocate_without_sleep[dsv2]" "$R::test_colocate_with_sleep[dsv2]" "$R::test_server[dsv2]")
FAULTS=("$F::test_1_wrong_model_is_refused_before_nccl_and_the_server_stays_usable"
  "$F::test_2_trainer_killed_after_start_weight_update" "$F::test_3_trainer_killed_mid_broadcast_is_reported_within_30s")
QWEN=("$R::test_colocate_without_sleep[qwen3moe]" "$R::test_colocate_with_sleep[qwen3moe]" "$R::test_server[qwen3moe]")
TP2=("$R::test_tensor_parallel_2[dsv2]" "$R::test_tensor_parallel_2[qwen3moe]")
case "${2:-all}" in  # a second call can run what the first one's timeout cut: e.g. `... OUT2 tp2`
  all) TESTS=("${DSV2[@]}" "${FAULTS[@]}" "${QWEN[@]}" "${TP2[@]}") ;;
  dsv2) TESTS=("${DSV2[@]}") ;; faults) TESTS=("${FAULTS[@]}") ;; qwen) TESTS=("${QWEN[@]}") ;; tp2) TESTS=("${TP2[@]}") ;;
  qwen+tp2) TESTS=("${QWEN[@]}" "${TP2[@]}") ;; colocate) TESTS=("${DSV2[@]:0:2}" "${QWEN[@]:0:2}") ;; faults+qwen+tp2) TESTS=("${FAULTS[@]}" "${QWEN[@]}" "${TP2[@]}") ;;
  *) echo "unknown part $2 (all, dsv2, faults, qwen, tp2, qwen+tp2, faults+qwen+tp2, colocate)"; exit 2 ;;
esac
T0=$(date +%s)
if [ ! -f "$VLLM_TEST_TINY_DIR/tiny-qwen3moe/config.json" ]; then
  TOK=/tmp/smol; [ -f $TOK/tokenizer_config.json ] || TOK=/tmp/bench-qwen05b
  timeout 180 $PY tests/gpu/make_tiny_models.py "$VLLM_TEST_TINY_DIR" --tokenizer $TOK 2>&1 | grep -v Writing | tee "$OUT/make_tiny_models.log"
fi
echo "models ready after $(( $(date +%s) - T0 )) s"
timeout -s INT -k 30 ${ISSUE14_TIMEOUT:-520} $PY -m pytest -v -rA -p no:cacheprovider --junitxml "$OUT/junit.xml" \
  "${TESTS[@]}" 2>&1 | tee "$OUT/pytest.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " | cut -c1-400
echo "pytest rc ${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
# a server a killed pytest left behind (its process group, started by tiny_models.Servers)
for pid in $(cat "$OUT/server.pid" 2>/dev/null); do kill -9 -- -"$pid" 2>/dev/null; done
$PY - "$OUT" <<'PY'
import glob, json, os, sys

out = sys.argv[1]
paths = sorted(p for p in glob.glob(os.path.join(out, "*.json")) if not p.endswith("results.json"))
results = {os.path.basename(p)[:-5]: json.load(open(p)) for p in paths}
json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
SKIP = {"model", "mode", "bound", "eager", "control_steps", "tokens", "killed_stdout"}


def flat(value, prefix=""):  # leaves as key=value, a comparison dict as its mean (and max), strings cut short
    if isinstance(value, dict) and "mean" in value:
        return [f"{prefix}={value['mean']:.4f}(max {value['max']:.2f})"]
    if isinstance(value, dict):
        return [item for k, v in value.items() if k not in SKIP for item in flat(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(value, float):
        return [f"{prefix}={value:.3g}"]
    return [f"{prefix}={str(value)[:300]}"]


for name, r in results.items():
    print(f"{name}: " + " ".join(flat(r)))
PY
