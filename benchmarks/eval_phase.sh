#!/usr/bin/env bash
# Issue 15's GPU runs: the addition task (SmolLM2-135M-Instruct, /tmp/smol) with a held-out eval set, our grpo.py,
# rloo.py and online_dpo.py (colocated vLLM, greedy pass@1 on the 200 prompts of addition_eval.jsonl at steps 0, 25,
# 50, 75, 100) and TRL 1.16's three trainers (benchmarks/trl_addition.py), all six at once on ONE GPU; then the plots.
# On a host prepared by the project's GPU notes (source .gpu/setup.sh: /tmp/smol, TRL 1.16, vLLM 0.26).
# Usage: bash benchmarks/eval_phase.sh OUT_DIR        (OUT_DIR new or empty; about EVAL_BUDGET_S + 1 min)
# Env:   EVAL_GPU (1)       the GPU, as CUDA_VISIBLE_DEVICES
#        EVAL_BUDGET_S (480) every run is stopped this many seconds after the start (its metrics.jsonl so far stays)
#        EVAL_VLLM_MEM (0.07) each colocated engine's share of the GPU (6 engines: 0.42 of 141 GB, the rest for the
#                           six trainers)
#        EVAL_COMMIT (git)  the commit recorded in addition_eval.json (the host's copy of the tree may have no .git)
#        EVAL_CPUS (unset)  a CPU list for taskset (e.g. 16-31), to keep these runs off cores that timing runs use
#        EVAL_DRY_RUN=1     CPU check of everything but the GPU: stories260K instead of SmolLM2, HF generate instead
#                           of vLLM, 2 steps, eval at steps 0, 1, 2; no TRL runs (about 1 minute on 2 cores)
# Writes OUT_DIR/<run>.log, OUT_DIR/<run>/metrics.jsonl (model weights deleted), OUT_DIR/plots/*.png (reward and
# eval/... against steps and wall-clock seconds, ours beside TRL), OUT_DIR/addition_eval.json (benchmarks/
# eval_summary.py: eval pass@1 per step, reward first/last 5 steps, wall time, exit status) and OUT_DIR/eval_runs.tgz
# (all of it, for a call whose returned files are few).
# Sharing one GPU: each engine starts alone, and all before any run trains (benchmarks/engine_turns.py: vLLM sizes
# its KV cache from the GPU's free memory, which other processes must not change meanwhile); no sleep mode (it frees
# and takes memory every step). Step times are those of six runs sharing a GPU: upper bounds, not speed results.
set -u
OUT=$1
if [ -n "$(ls -A "$OUT" 2> /dev/null)" ]; then echo "eval_phase.sh: $OUT is not empty: give a new folder"; exit 2; fi
mkdir -p "$OUT"
START=$(date +%s); END=$((START + ${EVAL_BUDGET_S:-480}))
timeout 60 python3 benchmarks/make_tasks.py /tmp/tasks > /dev/null || exit 1
if [ "${EVAL_DRY_RUN:-0}" != 1 ] && command -v nvidia-smi > /dev/null; then  # the GPU must be (nearly) free
  read -r used total <<< "$(timeout 30 nvidia-smi -i "${EVAL_GPU:-1}" --query-gpu=memory.used,memory.total --format=csv,noheader,nounits | tr -d ',')"
  echo "eval_phase.sh: GPU ${EVAL_GPU:-1}: ${used} of ${total} MiB in use before the runs"
  if [ "$((used * 4))" -gt "$total" ]; then  # the six runs need 6 x 0.07 for engines and ~35 GB for trainers
    timeout 30 nvidia-smi -i "${EVAL_GPU:-1}" --query-compute-apps=pid,used_memory,process_name --format=csv
    echo "eval_phase.sh: GPU ${EVAL_GPU:-1} is taken (a \`vllm serve\` left there?): free it or set EVAL_GPU"; exit 3
  fi
fi
export CUDA_VISIBLE_DEVICES=${EVAL_GPU:-1} WANDB_MODE=offline PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1
export ENGINE_TURN_TIMEOUT=240 ENGINE_BARRIER_TIMEOUT=$((${EVAL_BUDGET_S:-480} - 60))
MEM=${EVAL_VLLM_MEM:-0.07}
MODEL=/tmp/smol STEPS=100 EVERY=25 GEN="--use-vllm --vllm-mode colocate --vllm-gpu-memory-utilization $MEM"
if [ "${EVAL_DRY_RUN:-0}" = 1 ]; then  # stories260K, given a chat template for the task's chat-message prompts
  MODEL=$OUT/dry_run_model STEPS=2 EVERY=1 GEN="--no-use-vllm --no-bf16" OMP_NUM_THREADS=1
  timeout 120 python3 -c "import shutil, sys, transformers as t
shutil.copytree('tests/assets/stories260K', sys.argv[1]); tok = t.AutoTokenizer.from_pretrained(sys.argv[1])
tok.chat_template = \"{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\"
tok.save_pretrained(sys.argv[1])" "$MODEL" || exit 1
fi
# the issue's settings (16 prompts x 8 completions, 32 tokens, lr 1e-5, 100 steps); micro-batches of 4096 tokens
# (the default 16384 gives the same gradients with a larger memory peak, and six trainers share the GPU here)
ADD="--model-name-or-path $MODEL --dataset-name /tmp/tasks/addition.jsonl --prompt-column prompt --answer-column answer
     --reward-funcs gsm8k_accuracy --max-completion-length 32 --learning-rate 1e-5 --max-steps $STEPS
     --micro-batch-tokens 4096 --eval-dataset /tmp/tasks/addition_eval.jsonl --eval-steps $EVERY
     --log-completions 2 $GEN"
ADD=$(echo $ADD)  # one line: each RUNS entry below is read as one line
RUNS=(
  "ours_grpo grpo.py $ADD --prompts-per-step 16 --num-generations 8"
  "ours_rloo rloo.py $ADD --prompts-per-step 16 --num-generations 8"
  "ours_online_dpo online_dpo.py $ADD --prompts-per-step 64 --num-generations 4 --temperature 1.0 --beta 0.1"
)
if [ "${EVAL_DRY_RUN:-0}" != 1 ]; then
  for algo in grpo rloo online_dpo; do RUNS+=("trl_$algo benchmarks/trl_addition.py $algo $OUT/trl_$algo"); done
fi
TURNS=$(mktemp -d /tmp/eval_turns.XXXXXX)
PIN=""; [ -n "${EVAL_CPUS:-}" ] && PIN="taskset -c $EVAL_CPUS"

for i in "${!RUNS[@]}"; do  # all at once; benchmarks/engine_turns.py orders their engines' starts
  read -r name script args <<< "${RUNS[$i]}"
  case $name in ours_*) args="$args --output-dir $OUT/$name";; esac
  echo "== $name: python $script $args" > "$OUT/$name.log"
  (
    # its own rendezvous port for the colocated engine (external_launcher); timeout: TERM at END, KILL 20 s later
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29650 + i)) $PIN timeout -k 20 $(( END > $(date +%s) ? END - $(date +%s) : 1 )) \
      python3 benchmarks/engine_turns.py "$TURNS" "$i" "${#RUNS[@]}" $script $args >> "$OUT/$name.log" 2>&1
    echo "== $name exit $? after $(( $(date +%s) - START )) s" >> "$OUT/$name.log"
    touch "$TURNS/$i.ready"  # a run that ended before its engine started holds up no other
    rm -rf "$OUT/$name"/*.safetensors "$OUT/$name"/checkpoint-*  # keep metrics.jsonl and the logs, not the model
  ) &
done
wait
rm -rf "$TURNS"
grep -h "^== .* exit" "$OUT"/*.log

DONE=()
for i in "${!RUNS[@]}"; do
  read -r name _ <<< "${RUNS[$i]}"
  [ -s "$OUT/$name/metrics.jsonl" ] && DONE+=("$OUT/$name")
done
if [ ${#DONE[@]} -gt 0 ]; then
  timeout 180 python3 benchmarks/plot.py "${DONE[@]}" --out "$OUT/plots" > /dev/null || echo "eval_phase.sh: plot.py failed"
  timeout 60 python3 benchmarks/eval_summary.py "${DONE[@]}" --out "$OUT/addition_eval.json" ${EVAL_COMMIT:+--commit $EVAL_COMMIT} ||
    echo "eval_phase.sh: eval_summary.py failed"
fi
(cd "$OUT" && timeout 120 tar czf eval_runs.tgz --exclude=eval_runs.tgz ./*)
echo "eval_phase.sh: done in $(( $(date +%s) - START )) s"
