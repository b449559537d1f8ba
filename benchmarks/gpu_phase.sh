#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/, on a 2 x H200 host prepared by ../shared/gpu/README.md (source .gpu/setup.sh
# first). Usage: bash benchmarks/gpu_phase.sh learn|bench|check|bench_server|scale OUT_DIR
#   learn: GPU tests (colocate + sleep on GPU 0; server on GPU 1 + trainer on GPU 0), then the addition task with
#          SmolLM2-135M-Instruct (/tmp/smol) for 100 steps in server mode and in colocate mode (sleep on).
#   bench: bench-0.5b (/tmp/bench-qwen05b) for 8 steps: colocate (1 GPU), server (2 GPUs), no vLLM (1 GPU).
#   check: the GPU tests, rloo.py (colocate + server, 60 steps) and online_dpo.py (colocate, 100 steps) on the addition
#          task, packed onto the two GPUs; ends by starting the bench-0.5b server for bench_server.
#   bench_server: bench-0.5b in server mode (trainer GPU 0, server GPU 1).
#   scale: torchrun --nproc_per_node 2 (colocate): addition task, bench-0.5b, and one engine with tensor parallel 2.
#   eight_bench, eight_learn (8 GPUs): the layout of TRL's vLLM docs, a 4-GPU `vllm serve` on GPUs 0-3 and
#          `torchrun --nproc_per_node 4` on GPUs 4-7, for grpo.py, rloo.py and online_dpo.py; bench-0.5b for speed,
#          then the server sync test and the addition task with SmolLM2. Neither model splits 4 ways (14 and 9 attention
#          heads), so the 4 server GPUs are tensor parallel 2 x data parallel 2 (bench) and data parallel 4 (SmolLM2).
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

serve() {  # serve MODEL PORT [ARGS]: a stock vLLM server on GPU 1 (or $SERVER_GPUS), in its own session so that it
  local model=$1 port=$2; shift 2  # outlives this command
  CUDA_VISIBLE_DEVICES=${SERVER_GPUS:-1} VLLM_SERVER_DEV_MODE=1 setsid python3 -m vllm.entrypoints.cli.main serve "$model" --port "$port" --host 127.0.0.1 "$@" \
    --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1 \
    --api-server-count 4 \
    > "$OUT/server_$port.log" 2>&1 &
  echo "$(date +%s) started vllm serve $model on port $port" >> "$OUT/server_$port.log.start"
}
stop_servers() {  # the engine core renames itself VLLM::EngineCore: kill the whole session of each server
  for pid in $(pgrep -f "vllm.entrypoints.cli.main serve"); do kill -- -"$(ps -o sid= -p "$pid" | tr -d ' ')"; done
  sleep 5
}
wait_server() { python3 -c "import sys, vllm_utils; vllm_utils.wait_for_server('http://127.0.0.1:$1', 600, 'server')"; }
run() {  # run NAME TIMEOUT ARGS...: one run of grpo.py, or of rloo.py / online_dpo.py for names starting so
  local name=$1 limit=$2; shift 2
  local script=grpo.py; case $name in rloo*) script=rloo.py;; online_dpo*) script=online_dpo.py;; esac
  echo "== $name: ${LAUNCH:-python} $script $*" | tee "$OUT/$name.log"
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
if [ "$PHASE" = check ]; then  # tests/gpu, rloo.py (60 steps, colocate + server), online_dpo.py (100 steps, G=4 and G=2)
  # vLLM's start-up profiling asserts that no other process on its GPU frees memory meanwhile, and a sleeping engine
  # frees memory every step: so each engine starts while its GPU holds only servers and trainers that do not sleep.
  serve /tmp/smol 8000 --gpu-memory-utilization 0.4
  ADD_RLOO="${ADD/--max-steps 100/--max-steps 60}"
  DPO4="${ADD/--prompts-per-step 16 --num-generations 8/--prompts-per-step 64 --num-generations 4} --vllm-gpu-memory-utilization 0.2"
  DPO2="${ADD/--prompts-per-step 16 --num-generations 8/--prompts-per-step 64 --num-generations 2} --vllm-gpu-memory-utilization 0.2"
  CUDA_VISIBLE_DEVICES=0 GPU_RESULTS_DIR=$OUT timeout 200 python3 -m pytest -x -q tests/gpu/test_colocate.py 2>&1 | tee "$OUT/pytest_colocate.log"
  CUDA_VISIBLE_DEVICES=0 run rloo_colocate 300 --model-name-or-path /tmp/smol $ADD_RLOO --vllm-mode colocate --vllm-enable-sleep-mode &
  RLOO_COLOCATE=$!
  wait_server 8000
  CUDA_VISIBLE_DEVICES=1 run online_dpo_colocate 420 --model-name-or-path /tmp/smol $DPO4 --vllm-mode colocate --vllm-enable-sleep-mode &
  DPO_G4=$!
  GPU_RESULTS_DIR=$OUT VLLM_TEST_SERVER_URL=http://127.0.0.1:8000 timeout 120 python3 -m pytest -x -q tests/gpu/test_server.py 2>&1 | tee "$OUT/pytest_server.log"
  CUDA_VISIBLE_DEVICES=0 run rloo_server 240 --model-name-or-path /tmp/smol $ADD_RLOO --vllm-mode server --vllm-group-port 51302 &
  RLOO_SERVER=$!
  wait $RLOO_COLOCATE
  CUDA_VISIBLE_DEVICES=0 run online_dpo_colocate_g2 300 --model-name-or-path /tmp/smol $DPO2 --vllm-mode colocate --vllm-enable-sleep-mode &
  DPO_G2=$!
  wait $RLOO_SERVER; stop_servers
  wait $DPO_G4
  serve /tmp/bench-qwen05b 8001  # GPU 1 is free again: warm up the server of the bench_server phase
  wait $DPO_G2
fi
if [ "$PHASE" = bench_server ]; then
  pgrep -f "serve /tmp/bench-qwen05b" > /dev/null || serve /tmp/bench-qwen05b 8001
  wait_server 8001
  CUDA_VISIBLE_DEVICES=0 run bench_server 200 $BENCH --use-vllm --vllm-mode server --vllm-server-port 8001 --vllm-group-port 51301
  stop_servers
fi
if [ "$PHASE" = scale ]; then  # torchrun on 2 GPUs: colocated addition (sleep on), bench-0.5b with the same global batch
  export LAUNCH="python3 -m torch.distributed.run --nproc_per_node 2"
  CUDA_VISIBLE_DEVICES=0,1 run addition_colocate_2gpu 360 --model-name-or-path /tmp/smol $ADD --vllm-mode colocate --vllm-enable-sleep-mode
  CUDA_VISIBLE_DEVICES=0,1 run bench_colocate_2gpu 240 $BENCH --use-vllm --vllm-mode colocate
  # one vLLM engine spread over both ranks (tensor parallel 2; SmolLM2's 9 heads do not split, Qwen2.5-0.5B's 14 do)
  NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} CUDA_VISIBLE_DEVICES=0,1 run bench_colocate_2gpu_tp2 230 $BENCH --use-vllm --vllm-mode colocate --vllm-tensor-parallel-size 2 \
    --vllm-enable-sleep-mode
  unset LAUNCH
fi
if [ "$PHASE" = eight_bench ] || [ "$PHASE" = eight_learn ]; then
  # on hosts with NVLink multicast off, keep vLLM's FlashInfer all-reduce fusion (it maps multicast memory) off
  NOFUSE=""; [ "${NCCL_NVLS_ENABLE:-}" = 0 ] && NOFUSE='{"pass_config": {"fuse_allreduce_rms": false}}'
  export LAUNCH="python3 -m torch.distributed.run --nproc_per_node 4" SERVER_GPUS=0,1,2,3
fi
if [ "$PHASE" = eight_bench ]; then
  serve /tmp/bench-qwen05b 8001 --tensor-parallel-size 2 --data-parallel-size 2 ${NOFUSE:+--compilation-config "$NOFUSE"}
  wait_server 8001
  B20="${BENCH/--max-steps 8/--max-steps 20} --use-vllm --vllm-mode server --vllm-server-port 8001"
  CUDA_VISIBLE_DEVICES=4,5,6,7 run bench_server_4x4 150 $B20 --vllm-group-port 51310
  CUDA_VISIBLE_DEVICES=4,5,6,7 run rloo_bench_server_4x4 150 $B20 --vllm-group-port 51311
  CUDA_VISIBLE_DEVICES=4,5,6,7 run online_dpo_bench_server_4x4 150 ${B20/--beta 0/--beta 0.1} --vllm-group-port 51312
  stop_servers
fi
if [ "$PHASE" = eight_learn ]; then
  serve /tmp/smol 8000 --data-parallel-size 4
  wait_server 8000
  CUDA_VISIBLE_DEVICES=4 GPU_RESULTS_DIR=$OUT VLLM_TEST_SERVER_URL=http://127.0.0.1:8000 timeout 120 python3 -m pytest -x -q tests/gpu/test_server.py 2>&1 | tee "$OUT/pytest_server_dp4.log"
  CUDA_VISIBLE_DEVICES=4,5,6,7 run addition_server_4x4 150 --model-name-or-path /tmp/smol $ADD --vllm-mode server --vllm-group-port 51313
  CUDA_VISIBLE_DEVICES=4,5,6,7 run rloo_server_4x4 120 --model-name-or-path /tmp/smol ${ADD/--max-steps 100/--max-steps 60} --vllm-mode server --vllm-group-port 51314
  CUDA_VISIBLE_DEVICES=4,5,6,7 run online_dpo_server_4x4 120 --model-name-or-path /tmp/smol \
    ${ADD/--prompts-per-step 16 --num-generations 8 --max-completion-length 32 --learning-rate 1e-5 --max-steps 100/--prompts-per-step 64 --num-generations 4 --max-completion-length 32 --learning-rate 1e-5 --max-steps 60} \
    --vllm-mode server --vllm-group-port 51315
  stop_servers
fi
unset LAUNCH SERVER_GPUS
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
