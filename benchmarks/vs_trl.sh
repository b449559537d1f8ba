#!/usr/bin/env bash
# Side-by-side step times against TRL 1.16 on ONE host, at one sitting: the only fair speed comparison (absolute times
# drift between hosts and days), and the other runs behind docs/ that need a second GPU. On a host prepared by the
# project's GPU notes (source .gpu/setup.sh; TRL 1.16 on the path). Each phase fits a 10-minute call; runs alternate
# which goes first, two pairs per mode. Usage: bash benchmarks/vs_trl.sh PHASE OUT_DIR, the phases:
#   server:      bench-0.5b, trainer on GPU 0 and one `vllm serve` on GPU 1 shared by all runs (each pushes its own
#                weights first): PAIR=1 runs TRL, ours, ours --async-generation; PAIR=2 the same in reverse order
#                (~8 min each with the server's start and --torch-compile's first step). PAIR=lean runs only ours with
#                --async-generation --gradient-checkpointing --micro-batch-tokens 11520 (TRL's default and
#                micro-batch: its memory; the async step hides the slower trainer while it stays under generation).
#                docs/grpo.md's 2 x H200 rows (64834e3).
#   colocate:    bench-0.5b on GPU 0 (TRAIN_GPU), vLLM at 0.3 of the GPU, no sleep: TRL, ours, ours, TRL; ~9 min with
#                --torch-compile's first step, so PAIR=1 (TRL, ours) and PAIR=2 (ours, TRL) split it into two calls.
#                README.md's 0.54 x TRL and docs/grpo.md's 1 x H200 colocate rows (one GPU is enough).
#   learn_async: the addition task with SmolLM2-135M-Instruct, --async-generation, grpo.py / rloo.py / online_dpo.py
#                (SCRIPTS="online_dpo" runs a subset; SERVE_GPU / TRAIN_GPU pick the GPUs, default 1 / 0).
#   learn_colocate: the addition task colocated on GPU 0 (TRAIN_GPU), the three scripts at once (vLLM at 0.12 each)
#                plus grpo.py with --gradient-checkpointing: learning with the trainer's current defaults.
#   scale:       docs/scaling.md's numbers (0991fa0): bench-0.5b colocated on GPU 0, then under torchrun on GPUs 0 and 1
#                (2 ranks, the same global batch), then 2 ranks sharing one engine of tensor parallel 2 (sleep mode).
#   stop:        stop the `vllm serve` processes these phases started (colocate and learn_async expect a free GPU 1).
# The servers run with --api-server-count $API_SERVERS (4 unless set: docs/vllm.md, "HTTP front ends", says why).
# Extra flags for our bench runs (e.g. --gradient-checkpointing) go in $OURS_EXTRA. server and colocate end by writing
# OUT_DIR/vs_trl.json (benchmarks/summarize.py ratios, commit $COMMIT); scale and the learn phases by a table of the
# runs (summarize.py runs). Every command has a timeout.
set -u
PHASE=$1; OUT=$2; mkdir -p "$OUT"
timeout 60 python3 benchmarks/make_tasks.py /tmp/tasks > /dev/null
export WANDB_MODE=offline PYTHONUNBUFFERED=1
BENCH="--model-name-or-path /tmp/bench-qwen05b --dataset-name /tmp/tasks/bench.jsonl --prompt-column prompt
       --answer-column '' --no-use-chat-template --reward-funcs keyword_reward --prompts-per-step 32 --num-generations 8
       --max-completion-length 256 --beta 0 --learning-rate 1e-6 --max-steps 8 --use-vllm
       ${OURS_EXTRA:-}"
ADD="--model-name-or-path /tmp/smol --dataset-name /tmp/tasks/addition.jsonl --prompt-column prompt --answer-column answer
     --reward-funcs gsm8k_accuracy --max-completion-length 32 --learning-rate 1e-5 --max-steps 100 --use-vllm
     --vllm-mode server --async-generation"

serve() {  # serve MODEL PORT [ARGS]: `vllm serve` on GPU ${SERVE_GPU:-1} in its own session, so that it outlives this call
  local model=$1 port=$2; shift 2
  pgrep -f "serve $model --port $port" > /dev/null && return
  CUDA_VISIBLE_DEVICES=${SERVE_GPU:-1} VLLM_SERVER_DEV_MODE=1 setsid python3 -m vllm.entrypoints.cli.main serve "$model" --port "$port" --host 127.0.0.1 "$@" \
    --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1 \
    --api-server-count "${API_SERVERS:-4}" \
    > "$OUT/server_$port.log" 2>&1 &
}
wait_server() {  # wait_server PORT: until the server on PORT answers /health 200 (as the trainers wait), at most 300 s
  timeout 300 python3 -c "import time, urllib.request
while True:
    try:
        if urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=5).status == 200: break
    except OSError: pass
    time.sleep(2)" || { echo "vs_trl.sh: no server answered on port $1 within 300 s" >&2; exit 5; }
}
stop_servers() {
  for pid in $(pgrep -f "vllm.entrypoints.cli.main serve"); do kill -- -"$(ps -o sid= -p "$pid" | tr -d ' ')"; done
  sleep 5
}
ours() {  # ours NAME TIMEOUT SCRIPT ARGS... ($LAUNCH: the launcher, python3 unless set)
  local name=$1 limit=$2 script=$3; shift 3
  echo "== $name: python $script $*" | tee "$OUT/$name.log"
  eval timeout "$limit" ${LAUNCH:-python3} "$script" --output-dir "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$OUT/$name.log"
  find "$OUT/$name" -mindepth 1 ! -name metrics.jsonl -delete  # a device call returns at most 8 files: keep this one
}
trl() {  # trl NAME TIMEOUT MODE [PORT]
  local name=$1 limit=$2; shift 2
  echo "== $name: trl_bench.py $*" | tee "$OUT/$name.log"
  timeout "$limit" python3 benchmarks/trl_bench.py "$1" "$OUT/$name" "${2:-8000}" >> "$OUT/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$OUT/$name.log"
}

if [ "$PHASE" = server ]; then  # PAIR=1: TRL, ours, ours async; PAIR=2: the reverse order (one call each)
  serve /tmp/bench-qwen05b 8001; wait_server 8001
  S="--vllm-mode server --vllm-server-port 8001 --vllm-group-port 51301"
  export CUDA_VISIBLE_DEVICES=0
  P=${PAIR:-1}
  [ "$P" = 1 ] && trl trl_server_1 200 server 8001
  [ "$P" = lean ] && ours ours_lean_1 150 grpo.py $BENCH $S --async-generation --gradient-checkpointing \
    --micro-batch-tokens 11520
  [ "$P" = 2 ] && ours ours_async_2 150 grpo.py $BENCH $S --async-generation
  [ "$P" != lean ] && ours ours_server_$P 150 grpo.py $BENCH $S
  [ "$P" = 1 ] && ours ours_async_1 150 grpo.py $BENCH $S --async-generation
  [ "$P" = 2 ] && trl trl_server_2 200 server 8001
fi
[ "$PHASE" = stop ] && stop_servers
if [ "$PHASE" = colocate ]; then
  export CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0}
  [ "${PAIR:-1}" = 1 ] && trl trl_colocate_1 200 colocate
  [ "${PAIR:-1}" = 1 ] && ours ours_colocate_1 180 grpo.py $BENCH --vllm-mode colocate
  [ "${PAIR:-2}" = 2 ] && ours ours_colocate_2 180 grpo.py $BENCH --vllm-mode colocate
  [ "${PAIR:-2}" = 2 ] && trl trl_colocate_2 200 colocate
fi
if [ "$PHASE" = server ] || [ "$PHASE" = colocate ]; then
  timeout 60 python3 benchmarks/summarize.py ratios "$OUT" --commit "${COMMIT:-unknown}"
fi
if [ "$PHASE" = learn_async ]; then
  serve /tmp/smol 8000 --gpu-memory-utilization "${SERVER_MEM:-0.5}"; wait_server 8000
  export CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0}
  for s in ${SCRIPTS:-grpo rloo online_dpo}; do
    [ "$s" = online_dpo ] && n="--prompts-per-step 64 --num-generations 4" || n="--prompts-per-step 16 --num-generations 8"
    ours "${s}_addition_async" 200 "$s.py" $ADD $n --vllm-group-port 51313
  done
fi
if [ "$PHASE" = learn_colocate ]; then
  export CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0}
  C="${ADD/--vllm-mode server --async-generation/--vllm-mode colocate --vllm-gpu-memory-utilization 0.12}"
  for s in ${SCRIPTS:-grpo rloo online_dpo grpo_lean}; do
    [ "$s" = online_dpo ] && n="--prompts-per-step 64 --num-generations 4" || n="--prompts-per-step 16 --num-generations 8"
    [ "$s" = grpo_lean ] && n="$n --gradient-checkpointing"
    ours "${s}_addition_colocate" "${LIMIT:-420}" "${s%_lean}.py" $C $n &
    sleep 20
  done
  wait
fi
if [ "$PHASE" = scale ]; then  # as gpu_phase.sh ran it at 0991fa0 (its micro-batch then: 11520 tokens)
  B="$BENCH --micro-batch-tokens 11520 --vllm-mode colocate"
  CUDA_VISIBLE_DEVICES=0 ours bench_colocate 190 grpo.py $B
  export CUDA_VISIBLE_DEVICES=0,1 LAUNCH="python3 -m torch.distributed.run --nproc_per_node 2"
  ours bench_colocate_2gpu 190 grpo.py $B
  # one vLLM engine spread over both ranks (Qwen2.5-0.5B's 14 heads split in two); NVLink multicast off: docs/scaling.md
  NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} ours bench_colocate_2gpu_tp2 180 grpo.py $B --vllm-tensor-parallel-size 2 \
    --vllm-enable-sleep-mode
  unset LAUNCH
fi
if [[ $PHASE = learn_* || $PHASE = scale ]]; then
  DIRS=$(for d in "$OUT"/*/; do [ -s "$d/metrics.jsonl" ] && echo "${d%/}"; done)
  [ -n "$DIRS" ] && timeout 60 python3 benchmarks/summarize.py runs $DIRS
fi
