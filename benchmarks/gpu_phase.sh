#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/, on a 2 x H200 host prepared by ../shared/gpu/README.md (source .gpu/setup.sh
# first). Usage: bash benchmarks/gpu_phase.sh learn|bench OUT_DIR
#   learn: GPU tests (colocate + sleep on GPU 0; server on GPU 1 + trainer on GPU 0), then the addition task with
#          SmolLM2-135M-Instruct (/tmp/smol) for 100 steps in server mode and in colocate mode (sleep on).
#   bench: bench-0.5b (/tmp/bench-qwen05b) for 8 steps: colocate (1 GPU), server (2 GPUs), no vLLM (1 GPU).
# Every run writes <OUT_DIR>/<name>/metrics.jsonl and <name>.log; benchmarks/summarize.py turns them into JSON.
set -u
PHASE=$1; OUT=$2; mkdir -p "$OUT"
python3 benchmarks/make_tasks.py /tmp/tasks > /dev/null
export WANDB_MODE=offline PYTHONUNBUFFERED=1
ADD="--dataset-name /tmp/tasks/addition.jsonl --prompt-column prompt --answer-column answer --reward-funcs gsm8k_accuracy
     --prompts-per-step 16 --num-generations 8 --max-completion-length 32 --learning-rate 1e-5 --max-steps 100 --use-vllm"
BENCH="--model-name-or-path /tmp/bench-qwen05b --dataset-name /tmp/tasks/bench.jsonl --prompt-column prompt --answer-column ''
       --no-use-chat-template --reward-funcs keyword_reward --prompts-per-step 32 --num-generations 8
       --max-completion-length 256 --micro-batch-tokens 11520 --beta 0 --learning-rate 1e-6 --max-steps 8"

serve() {  # serve MODEL PORT: a stock vLLM server on GPU 1, in its own session so that it outlives this command
  CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 setsid python3 -m vllm.entrypoints.cli.main serve "$1" --port "$2" \
    --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1 \
    > "$OUT/server_$2.log" 2>&1 &
  echo "$(date +%s) started vllm serve $1 on port $2" >> "$OUT/server_$2.log.start"
}
stop_servers() {  # the engine core renames itself VLLM::EngineCore: kill the whole session of each server
  for pid in $(pgrep -f "vllm.entrypoints.cli.main serve"); do kill -- -"$(ps -o sid= -p "$pid" | tr -d ' ')"; done
  sleep 5
}
wait_server() { python3 -c "import sys, vllm_utils; vllm_utils.wait_for_server('http://127.0.0.1:$1', 600, 'server')"; }
run() {  # run NAME TIMEOUT ARGS...: one grpo.py run
  local name=$1 limit=$2; shift 2
  echo "== $name: python grpo.py $*" | tee "$OUT/$name.log"
  local script=grpo.py; case $name in rloo*) script=rloo.py;; online_dpo*) script=online_dpo.py;; esac
  eval timeout "$limit" ${LAUNCH:-python3} $script --output-dir "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$OUT/$name.log"
}

if [ "$PHASE" = learn ]; then
  serve /tmp/smol 8000; T0=$(date +%s)
  CUDA_VISIBLE_DEVICES=0 GPU_RESULTS_DIR=$OUT timeout 240 python3 -m pytest -x -q tests/gpu/test_colocate.py 2>&1 | tee "$OUT/pytest_colocate.log"
  wait_server 8000 && echo "server ready after $(( $(date +%s) - T0 )) s" | tee "$OUT/server_ready.txt"
  GPU_RESULTS_DIR=$OUT VLLM_TEST_SERVER_URL=http://127.0.0.1:8000 timeout 180 python3 -m pytest -x -q tests/gpu/test_server.py 2>&1 | tee "$OUT/pytest_server.log"
  # server mode (trainer GPU 0, server GPU 1) and colocate mode (GPU 0, sleep on) side by side
  CUDA_VISIBLE_DEVICES=0 run addition_server 360 --model-name-or-path /tmp/smol $ADD --vllm-mode server --vllm-group-port 51300 &
  CUDA_VISIBLE_DEVICES=0 run addition_colocate 360 --model-name-or-path /tmp/smol $ADD --vllm-mode colocate --vllm-enable-sleep-mode
  wait
  stop_servers
  serve /tmp/bench-qwen05b 8001  # warm for the bench phase
fi
if [ "$PHASE" = bench ]; then
  pgrep -f "serve /tmp/bench-qwen05b" > /dev/null || serve /tmp/bench-qwen05b 8001
  CUDA_VISIBLE_DEVICES=0 run bench_colocate 240 $BENCH --use-vllm --vllm-mode colocate
  wait_server 8001
  CUDA_VISIBLE_DEVICES=0 run bench_server 200 $BENCH --use-vllm --vllm-mode server --vllm-server-port 8001 --vllm-group-port 51301
  CUDA_VISIBLE_DEVICES=0 run bench_no_vllm 300 $BENCH --no-use-vllm
  stop_servers
fi
if [ "$PHASE" = algos ]; then  # rloo.py (60 steps) and online_dpo.py (100 steps) on the addition task
  serve /tmp/smol 8000
  ADD_RLOO="${ADD/--max-steps 100/--max-steps 60}"
  CUDA_VISIBLE_DEVICES=0 run rloo_colocate 300 --model-name-or-path /tmp/smol $ADD_RLOO --vllm-mode colocate --vllm-enable-sleep-mode
  wait_server 8000
  CUDA_VISIBLE_DEVICES=0 run rloo_server 240 --model-name-or-path /tmp/smol $ADD_RLOO --vllm-mode server --vllm-group-port 51302
  stop_servers
fi
if [ "$PHASE" = dpo ]; then
  DPO="${ADD/--prompts-per-step 16 --num-generations 8/--prompts-per-step 64 --num-generations 4}"
  CUDA_VISIBLE_DEVICES=0 run online_dpo_colocate 400 --model-name-or-path /tmp/smol $DPO --vllm-mode colocate --vllm-enable-sleep-mode
fi
if [ "$PHASE" = bench_server ]; then
  serve /tmp/bench-qwen05b 8001; wait_server 8001
  CUDA_VISIBLE_DEVICES=0 run bench_server 200 $BENCH --use-vllm --vllm-mode server --vllm-server-port 8001 --vllm-group-port 51301
  stop_servers
fi
if [ "$PHASE" = scale ]; then  # torchrun on 2 GPUs: colocated addition (sleep on), bench-0.5b with the same global batch
  export LAUNCH="python3 -m torch.distributed.run --nproc_per_node 2"
  CUDA_VISIBLE_DEVICES=0,1 run addition_colocate_2gpu 360 --model-name-or-path /tmp/smol $ADD --vllm-mode colocate --vllm-enable-sleep-mode
  CUDA_VISIBLE_DEVICES=0,1 run bench_colocate_2gpu 240 $BENCH --use-vllm --vllm-mode colocate
  unset LAUNCH
fi
if [ "$PHASE" = tests ]; then  # the two GPU tests, then bench-0.5b without vLLM
  serve /tmp/smol 8000
  CUDA_VISIBLE_DEVICES=0 GPU_RESULTS_DIR=$OUT timeout 200 python3 -m pytest -x -q tests/gpu/test_colocate.py 2>&1 | tee "$OUT/pytest_colocate.log"
  wait_server 8000
  GPU_RESULTS_DIR=$OUT VLLM_TEST_SERVER_URL=http://127.0.0.1:8000 timeout 120 python3 -m pytest -x -q tests/gpu/test_server.py 2>&1 | tee "$OUT/pytest_server.log"
  stop_servers
  [ -n "${WITH_BENCH:-}" ] && CUDA_VISIBLE_DEVICES=0 run bench_no_vllm 170 $BENCH --no-use-vllm
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
