#!/usr/bin/env bash
# The runs behind the published one-GPU numbers, on a 1 x H200 host prepared by ../shared/gpu/README.md (source
# .gpu/setup.sh first; TRL 1.16 on the path). Each phase fits one 10-minute device call; every command in it has a
# timeout. Usage: bash benchmarks/one_gpu.sh PHASE OUT_DIR, the phases:
#   serve: starts the compiled bench-0.5b IPC server(s) (port 8001; SERVERS=2: 8001 and 8011) in a session of their
#          own: they outlive the call, and boot while later calls bring the rest of the payload. A fixed KV cache each.
#   bench: bench-0.5b side by side (README.md's speed table, docs/vllm.md "Measured"), PAIR=1: TRL colocate, ours
#          colocate, ours one-GPU server, ours one-GPU server --async-generation; PAIR=2 the same in reverse order.
#          Writes OUT_DIR/vs_trl.json (summarize.py ratios, $COMMIT). SERVERS=2: ours against two servers on the GPU
#          (ports 8001 and 8011), each round shared between them (6215430's rows: SERVERS=2 SIDES="trl server async").
#          SIDES: which of trl, colocate, server and async run (all four by default), in PAIR=1's order;
#          async_one: --async-generation against the first server only (with SERVERS=2: one server against two).
#          BENCH_MODEL=/tmp/bench-qwen15b (../shared/gpu/make_bench_model.py TOK OUT 1.5b) for the 1.5B shape: its
#          server is started on port 8002 (stop the 0.5b one first: both would not fit beside a trainer).
#          MPS=1: the servers (ports 8061 / 8062 and on) and the trainers of the server sides are clients of a CUDA
#          MPS daemon (started here: nvidia-cuda-mps-control -d, pipe /tmp/mps/pipe), so that their kernels can run at
#          once instead of taking turns on the GPU; TRL and our colocate runs stay outside it (a process finds no daemon
#          at the default pipe). ASYNC_FLAGS: more flags for the async sides (e.g. --micro-batch-tokens 32768).
#          970e4b4's bench-1.5b rows: benchmarks/results/README.md gives the calls.
#   mps_stop: stops the MPS=1 bench servers of BENCH_MODEL, then the MPS daemon.
#   check: starts the bench-0.5b server unless it runs, the learning runs of $RUNS (the addition task with
#          SmolLM2-135M-Instruct, 100 steps; by default the three scripts against their own eager IPC servers, grpo.py
#          also with --async-generation and with --use-peft: all share the GPU), and tests/gpu/test_server_ipc.py
#          (the sync check for the two tiny MoE models, two servers taking one push, then bench-0.5b once its server
#          is up). RUNS entries are name:script:server[:flags, comma-separated[:servers]]; 068161e's six runs were
#          each script without and with --async-generation.
#   learn: the learning runs of $RUNS against eager IPC servers of their own (by default grpo.py against two servers,
#          with and without --async-generation: README.md's 0.086 -> 0.830), in a session of their own: give it a
#          directory that outlives the call (/root/learn); OUT_DIR/learn.out says when done.
#   colocate: the learning runs of $COLOCATE_RUNS, colocated (vLLM at 0.07 each; by default the three scripts with
#          --use-peft, grpo.py at two learning rates: docs/lora.md's table), in a session of their own: the call
#          returns at once, the runs go on (benchmarks/engine_turns.py starts their engines one at a time);
#          OUT_DIR/colocate.out says when done.
#   lora7b: LoRA (r 16, alpha 32, every linear layer) on the random-init Qwen2.5-7B shape (/tmp/bench-qwen7b:
#          make_bench_model.py TOK /tmp/bench-qwen7b 7b), colocate with sleep mode, the bench workload: PAIR=1 ours
#          then TRL 1.16 (LORA_R=16 SLEEP=1), PAIR=2 the reverse; SIDES=trl_memory: ours at TRL's memory settings.
#          No other vLLM may hold memory (stop the servers). README.md's 0.50 x TRL, docs/lora.md.
#   lora15: bench-1.5b (/tmp/bench-qwen15b), ours full fine-tuning then LoRA, colocate with sleep mode (docs/lora.md).
#   eval:  docs/evaluation.md's runs and README.md's plot: the addition task with a held-out eval set, our grpo.py,
#          rloo.py and online_dpo.py (colocated vLLM, greedy pass@1 on the 200 prompts of addition_eval.jsonl at steps
#          0, 25, 50, 75, 100) and TRL 1.16's three trainers (benchmarks/trl_addition.py), all six at once on the GPU,
#          each engine started in its turn (engine_turns.py; no sleep mode: it frees and takes memory every step).
#          OUT_DIR new or empty. EVAL_BUDGET_S (480): every run is stopped this many seconds after the start;
#          EVAL_VLLM_MEM (0.07) each engine's share; EVAL_COMMIT (git) the commit recorded; EVAL_CPUS: a CPU list for
#          taskset; EVAL_DRY_RUN=1: the CPU check of all but the GPU (stories260K, HF generate, 2 steps, no TRL; about
#          1 minute on 2 cores). Writes OUT_DIR/<run>.log, <run>/metrics.jsonl, plots/*.png (plot.py: reward and
#          eval/... against steps and seconds, and reward_vs_trl.png), addition_eval.json (summarize.py runs) and
#          eval_runs.tgz (all of it). Step times are those of six runs sharing a GPU: upper bounds, not speeds.
#   ab:    issue 44's speed check, bench-0.5b: the grpo.py of $OLD_DIR (an older commit's grpo.py, vllm_utils.py and
#          rewards.py: `git show C:F > bench_old/F` for each; bench_old/ is git-ignored, so carry it; OLD_COMMIT or
#          OLD_DIR/COMMIT names C) against this tree's, with the bench phase's flags. PAIR=1: old then new; PAIR=2:
#          new then old; PAIR=3 and 4 (a third and fourth pair) as 1 and 2. MODE=colocate (the default; bench's colocate side) or MODE=async (bench's async side:
#          --vllm-mode server --async-generation against the SERVERS=2 servers of `serve`, ports 8001 and 8011, started
#          here unless they run). Writes OUT_DIR/{old,new}_MODE_PAIR.metrics.jsonl and .log, then OUT_DIR/ab.json
#          (summarize.py ab: the median of steps 3-8 of each run, new / old per pair and both pairs pooled, per mode).
#   vision: issue 45 on the GPU, one part per call (VISION=...): tests (tests/gpu/test_vision_gpu.py: vLLM colocated
#          holds the trainer's VLM weights, and its control; grpo.py learns the colour task with vLLM colocated and with
#          an IPC server, sync and async; K=... picks some), encoder (make_vlm_bench.py --encoder's seconds and peak
#          memory on the random-init Qwen2.5-VL-3B shape and the counting task, both built once), vs_trl RUNS="..."
#          (those runs in that order, of ours_vlm_N and trl_vlm_N: GRPO colocated against TRL 1.16 on that shape, 8
#          prompts x 8 x 64 tokens, 8 steps, bf16 weights and the tower training on both sides; OUT_DIR/vs_trl.json once
#          a pair is complete; RUN_LIMIT: seconds a run, 330; OURS_EXTRA: more flags, the last of a flag wins), server
#          (docs/vision.md's one-GPU server mode on that shape: an IPC server at 0.3 of the GPU, then ours against it
#          with OURS_EXTRA, else the defaults: fp32 weights, the tower frozen). Results in OUT_DIR.
set -u
PHASE=$1; OUT=$2; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the ab phase's old runs start elsewhere
case $PHASE in
  serve|bench|mps_stop|check|learn|learn_runs|colocate|colocate_runs|lora7b|lora15|eval|ab|vision) ;;
  *) echo "one_gpu.sh: unknown phase $PHASE (see the header)" >&2; exit 2 ;;
esac
# a bare host (lost between calls, or a call that ran before the payload's) fails now, not after a server's timeout
[ "$PHASE:${EVAL_DRY_RUN:-0}" = eval:1 ] || timeout 120 python3 -c "import vllm" 2> /dev/null ||
  { echo "one_gpu.sh: no vllm here: transfer the payload, source .gpu/setup.sh" >&2; exit 3; }
[ -f /tmp/tasks/addition.jsonl ] || timeout 60 python3 benchmarks/make_tasks.py /tmp/tasks > /dev/null  # once
export WANDB_MODE=offline PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
BENCH="--model-name-or-path /tmp/bench-qwen05b --dataset-name /tmp/tasks/bench.jsonl --prompt-column prompt
       --answer-column '' --no-use-chat-template --reward-funcs keyword_reward --prompts-per-step 32 --num-generations 8
       --max-completion-length 256 --beta 0 --learning-rate 1e-6 --max-steps 8 --use-vllm"
ADD="--model-name-or-path /tmp/smol --dataset-name /tmp/tasks/addition.jsonl --prompt-column prompt --answer-column answer
     --reward-funcs gsm8k_accuracy --max-completion-length 32 --learning-rate 1e-5 --max-steps 100 --use-vllm
     --vllm-mode server"

serve_ipc() {  # serve_ipc MODEL PORT [ARGS]: an IPC `vllm serve` on this GPU, in its own session (outlives the call)
  local model=$1 port=$2; shift 2
  pgrep -f "serve $model --port $port" > /dev/null && return
  mkdir -p "${SERVER_LOGS:-$OUT}"
  env $MPS_ENV VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 setsid \
    python3 -m vllm.entrypoints.cli.main serve "$model" --port "$port" --weight-transfer-config '{"backend": "ipc"}' \
    --host 127.0.0.1 --logprobs-mode processed_logprobs --max-logprobs -1 \
    "$@" > "${SERVER_LOGS:-$OUT}/server_$port.log" 2>&1 &  # SERVER_LOGS: a folder that outlives the call
}
tiny_models() {  # once per host: phases that run at the same time must not write them at the same time
  [ -f /tmp/tiny-models/made ] && return
  timeout 300 python3 tests/gpu/make_tiny_models.py /tmp/tiny-models > "$OUT/make_tiny.log" 2>&1 &&
    touch /tmp/tiny-models/made
}
stop_servers() {  # stop_servers REGEX: each `vllm serve` whose command line matches, with its session (front ends,
  # EngineCore); a pattern, not "every server": another phase's servers may be running
  local pid sid
  for pid in $(pgrep -f "$1"); do
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    [ -n "$sid" ] && kill -- -"$sid"
  done
}
wait_server() {  # wait_server PORT [SECONDS]: until the server on PORT answers /health 200 (as the trainers wait)
  timeout "${2:-300}" python3 -c "import time, urllib.request
while True:
    try:
        if urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=5).status == 200: break
    except OSError: pass
    time.sleep(2)" || { echo "one_gpu.sh: no server answered on port $1 within ${2:-300} s" >&2; return 1; }
}
ours() {  # ours NAME TIMEOUT SCRIPT ARGS...
  local name=$1 limit=$2 script=$3; shift 3
  echo "== $name: python $script $*" > "$OUT/$name.log"
  eval timeout "$limit" env ${RUN_ENV:-} python3 "$script" --output-dir "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$OUT/$name.log"
  find "$OUT/$name" -mindepth 1 ! -name metrics.jsonl -delete  # a device call returns few files: keep this one
}
trl() {  # trl NAME TIMEOUT (BENCH_MODEL reaches trl_bench.py through the environment)
  echo "== $1: trl_bench.py colocate ${BENCH_MODEL:-}" > "$OUT/$1.log"
  timeout "$2" python3 benchmarks/trl_bench.py colocate "$OUT/$1" >> "$OUT/$1.log" 2>&1
  echo "== $1 exit $?" | tee -a "$OUT/$1.log"
}

MODEL=${BENCH_MODEL:-/tmp/bench-qwen05b}; PORT=8001; [ "$MODEL" != /tmp/bench-qwen05b ] && PORT=8002
BENCH="${BENCH/\/tmp\/bench-qwen05b/$MODEL}"
MPS_ENV=""  # MPS=1 (bench, serve, ab, mps_stop): see the header
case "$PHASE:${MPS:-0}" in
  bench:*|serve:*|ab:*|mps_stop:1) ;;
  mps_stop:*) echo "one_gpu.sh: mps_stop needs MPS=1 (and the servers' BENCH_MODEL / SERVERS)" >&2; exit 2 ;;
  *:1) echo "one_gpu.sh: MPS=1 applies to bench, serve, ab and mps_stop only, not $PHASE" >&2; exit 2 ;;
esac
if [ "${MPS:-0}" = 1 ]; then
  MPS_ENV="CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log"; PORT=$((PORT + 60))
  command -v nvidia-cuda-mps-control > /dev/null || { echo "one_gpu.sh: no nvidia-cuda-mps-control" >&2; exit 4; }
  mkdir -p /tmp/mps/pipe /tmp/mps/log
  if [ "$PHASE" != mps_stop ] &&
    ! echo get_server_list | env $MPS_ENV timeout 30 nvidia-cuda-mps-control > /dev/null 2>&1; then
    env $MPS_ENV nvidia-cuda-mps-control -d || { echo "one_gpu.sh: the MPS daemon did not start" >&2; exit 4; }
  fi
fi
[ "$PHASE" = ab ] && [ "${MODE:-colocate}" = async ] && SERVERS=${SERVERS:-2}  # ab's async runs: two servers
# SERVERS=2: two bench servers (ports PORT and PORT + 10) that the trainer shares each round between
PORTS=$(seq -s ' ' $PORT 10 $((PORT + 10 * (${SERVERS:-1} - 1))))
serve_bench() {  # compiled, as a user's server would be; $SERVE_FLAGS: more flags (e.g. a smaller KV cache)
  local p
  for p in $PORTS; do
    serve_ipc "$MODEL" "$p" --gpu-memory-utilization 0.35 --kv-cache-memory-bytes 17179869184 \
      --max-model-len 2048 --api-server-count 4 ${SERVE_FLAGS:-}
  done
}

learn_runs() {  # learn_runs [MEANWHILE]: $RUNS' learning runs, each against an eager IPC server of its own (ports
  # 8100+); MEANWHILE (a function) runs while they train; then their servers stop, and a summary
  EAGER_SMALL="--gpu-memory-utilization 0.04 --kv-cache-memory-bytes 2147483648 --max-model-len 1024 --enforce-eager
               --api-server-count 1"
  # RUNS: name:script:mode[:extra flags, comma-separated[:servers (default 1), each an eager IPC server of its own]]
  local i=0 trainers="" r name s mode extra servers n ports port
  for r in $RUNS; do
    IFS=: read -r name s mode extra servers <<< "$r"
    [ "$s" = online_dpo ] && n="--prompts-per-step 64 --num-generations 4" || n="--prompts-per-step 16 --num-generations 8"
    n="$n ${extra//,/ }"  # a later --learning-rate replaces ADD's (tyro: the last one wins)
    ports=""
    for _ in $(seq "${servers:-1}"); do
      port=$((8100 + i)); i=$((i + 1)); serve_ipc /tmp/smol $port $EAGER_SMALL; ports="$ports $port"
    done
    n="$n --vllm-server-port$ports --vllm-server-timeout 300"
    (sleep 5; OMP_NUM_THREADS=2 ours "$name" "${LEARN_LIMIT:-420}" "$s.py" $ADD $n) &
    trainers="$trainers $!"
  done
  [ -n "${1:-}" ] && "$1"
  wait $trainers  # not the servers: they never end by themselves
  stop_servers "serve /tmp/smol --port 81[0-9][0-9]"  # these runs' servers only
  local dirs; dirs=$(for r in $RUNS; do [ -s "$OUT/${r%%:*}/metrics.jsonl" ] && echo "$OUT/${r%%:*}"; done)
  [ -n "$dirs" ] && timeout 60 python3 benchmarks/summarize.py runs $dirs > "$OUT/learn_summary.txt" 2>&1
  cat "$OUT/learn_summary.txt" 2> /dev/null
}
sync_tests() {
  tiny_models
  GPU_RESULTS_DIR=$OUT VLLM_TEST_BENCH_URL=http://127.0.0.1:8001 timeout 500 python3 -m pytest -x -q -rs \
    tests/gpu/test_server_ipc.py 2>&1 | tee "$OUT/pytest_ipc.log"
}

[ "$PHASE" = serve ] && serve_bench
if [ "$PHASE" = check ]; then
  # the colocated engines of a `colocate` phase started before this one size their KV cache from the free memory:
  # let them all start first ($TURNS_DIR: that phase's OUT_DIR/turns; 4 engines unless $TURNS_COUNT)
  for _ in $(seq 240); do
    [ -z "${TURNS_DIR:-}" ] || [ "$(ls "$TURNS_DIR"/*.ready 2>/dev/null | wc -l)" -ge "${TURNS_COUNT:-4}" ] && break
    sleep 1
  done
  serve_bench
  RUNS=${RUNS:-"grpo_ipc_sync:grpo:server rloo_ipc_sync:rloo:server online_dpo_ipc_sync:online_dpo:server
    grpo_ipc_async:grpo:server:--async-generation grpo_lora_ipc_sync:grpo:server:--use-peft,--learning-rate,2e-4"}
  learn_runs sync_tests
fi
if [ "$PHASE" = learn ]; then  # $RUNS (as check's) in a session of their own: the call returns, the runs go on
  setsid bash "$0" learn_runs "$OUT" > "$OUT/learn.out" 2>&1 < /dev/null &
fi
if [ "$PHASE" = learn_runs ]; then
  RUNS=${RUNS:-"grpo_2servers_sync:grpo:server::2 grpo_2servers_async:grpo:server:--async-generation:2"}
  learn_runs
  echo "learning runs done"
fi
if [ "$PHASE" = bench ]; then
  serve_bench; for p in $PORTS; do wait_server "$p" || exit 5; done
  S="--vllm-mode server --vllm-server-port $PORTS"
  P=${PAIR:-1}; ORDER=${SIDES:-trl colocate server async}  # PAIR=2 runs them in the reverse order
  [ "$P" = 1 ] || ORDER=$(echo $ORDER | tr ' ' '\n' | tac | tr '\n' ' ')
  for side in $ORDER; do
    case $side in
      trl) trl trl_colocate_$P "${TRL_LIMIT:-200}" ;;  # the limits: raise them for bench-1.5b
      colocate) ours ours_colocate_$P "${COLOCATE_LIMIT:-260}" grpo.py $BENCH --vllm-mode colocate ;;
      server) RUN_ENV=$MPS_ENV ours ours_server1gpu_$P "${SERVER_LIMIT:-150}" grpo.py $BENCH $S ;;
      async) RUN_ENV=$MPS_ENV ours ours_async1gpu_$P "${SERVER_LIMIT:-150}" grpo.py $BENCH $S --async-generation \
        ${ASYNC_FLAGS:-} ;;
      async_one) RUN_ENV=$MPS_ENV ours ours_async1srv_$P "${SERVER_LIMIT:-150}" grpo.py $BENCH --vllm-mode server \
        --vllm-server-port $PORT --async-generation ${ASYNC_FLAGS:-} ;;  # SERVERS=2: the first server only
      *) echo "bench: unknown side $side (trl, colocate, server, async or async_one)" >&2; exit 2 ;;
    esac
  done
  timeout 60 python3 benchmarks/summarize.py ratios "$OUT" --commit "${COMMIT:-unknown}" --model "$MODEL"
fi
if [ "$PHASE" = mps_stop ]; then  # the MPS=1 bench servers of this model, then the daemon (it waits for its clients)
  stop_servers "serve $MODEL --port ($(echo $PORTS | tr ' ' '|'))"; sleep 5
  echo quit | env $MPS_ENV timeout 60 nvidia-cuda-mps-control; echo "== mps_stop exit $?"
fi
if [ "$PHASE" = ab ]; then  # bench-0.5b, OLD_DIR's grpo.py against this tree's, with the bench phase's flags
  MODE=${MODE:-colocate}; P=${PAIR:-1}
  [ -f "${OLD_DIR:-}/grpo.py" ] || { echo "ab: OLD_DIR must hold an older commit's grpo.py, vllm_utils.py and \
rewards.py (git show C:grpo.py > bench_old/grpo.py, ...)" >&2; exit 2; }
  case $P in 1|2|3|4) ;; *) echo "ab: PAIR=1 or 3 (old first), 2 or 4 (new first), not $P" >&2; exit 2 ;; esac
  OLD_SCRIPT=$(cd "$OLD_DIR" && pwd)/grpo.py  # imports the vllm_utils.py and rewards.py beside it
  case $MODE in
    colocate) FLAGS="--vllm-mode colocate"; LIMIT=${COLOCATE_LIMIT:-250}; AB_ENV="" ;;
    async) serve_bench; for p in $PORTS; do wait_server "$p" || exit 5; done
      FLAGS="--vllm-mode server --vllm-server-port $PORTS --async-generation ${ASYNC_FLAGS:-}"
      LIMIT=${SERVER_LIMIT:-150}; AB_ENV=$MPS_ENV ;;
    *) echo "ab: MODE=colocate or MODE=async, not $MODE" >&2; exit 2 ;;
  esac
  ab_run() {  # ab_run old|new: one run; its metrics.jsonl becomes OUT_DIR/<old|new>_<mode>_<pair>.metrics.jsonl
    local name=$1_${MODE}_$P script=grpo.py
    [ "$1" = old ] && script=$OLD_SCRIPT
    rm -f "$OUT/$name.metrics.jsonl"  # a run that fails now leaves none: no earlier call's file stands in for it
    RUN_ENV=$AB_ENV ours "$name" "$LIMIT" "$script" $BENCH $FLAGS
    mv "$OUT/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2> /dev/null; rmdir "$OUT/$name" 2> /dev/null
  }
  if [ $((P % 2)) = 1 ]; then ab_run old; ab_run new; else ab_run new; ab_run old; fi
  OLD_COMMIT=${OLD_COMMIT:-$(cat "$OLD_DIR/COMMIT" 2> /dev/null || echo unknown)}
  timeout 60 python3 benchmarks/summarize.py ab "$OUT" --commit "${COMMIT:-unknown}" --old-commit "$OLD_COMMIT"
fi
if [ "$PHASE" = lora7b ]; then  # SIDES (default by PAIR: "ours trl" or "trl ours") picks the runs of this call
  export MAX_STEPS=${MAX_STEPS:-8}  # both sides; the medians are of steps 3 to the last
  L="${BENCH//$MODEL//tmp/bench-qwen7b} --max-steps $MAX_STEPS --vllm-mode colocate --vllm-enable-sleep-mode --use-peft --lora-r 16 --lora-alpha 32"
  P=${PAIR:-1}; [ "$P" = 1 ] && ORDER="ours trl" || ORDER="trl ours"
  for side in ${SIDES:-$ORDER}; do
    case $side in
      ours) ours ours_lora7b_$P 290 grpo.py $L ;;
      trl) BENCH_MODEL=/tmp/bench-qwen7b LORA_R=16 SLEEP=1 trl trl_lora7b_$P 290 ;;
      # TRL's memory settings: its gradient checkpointing and its 32-row micro-batch (32 x (75 + 256) tokens)
      trl_memory) ours ours_lora7b_trl_memory 290 grpo.py $L --gradient-checkpointing --micro-batch-tokens 10592 ;;
      *) echo "lora7b: unknown side $side (ours, trl or trl_memory)" >&2; exit 2 ;;
    esac
  done
  timeout 60 python3 benchmarks/summarize.py ratios "$OUT" --commit "${COMMIT:-unknown}" --model "$MODEL"
fi
if [ "$PHASE" = vision ]; then  # VISION=tests|encoder|vs_trl (see the header)
  VLM=/tmp/bench-qwen25vl3b; DATA=/tmp/tasks/vlm_count/count.jsonl
  VLM_RUN="--model-name-or-path $VLM --dataset-name $DATA --prompt-column prompt --reward-funcs first_word_reward
           --prompts-per-step 8 --num-generations 8 --max-completion-length 64 --beta 0 --learning-rate 1e-6
           --max-steps 8 --use-vllm"
  case ${VISION:-tests} in
    tests)
      # (tests/gpu runs only where VLLM_TEST_MODEL exists; these tests build their own tiny VLM)
      VLLM_TEST_MODEL=${VLLM_TEST_MODEL:-/tmp/bench-qwen05b} GPU_RESULTS_DIR=$OUT timeout 570 python3 -m pytest -q \
        tests/gpu/test_vision_gpu.py \
        -k "${K:-colocate_holds or learns}" > "$OUT/vision.log" 2>&1
      tail -5 "$OUT/vision.log" ;;
    encoder|vs_trl|server)
      [ -f $VLM/config.json ] || timeout 300 python3 benchmarks/make_vlm_bench.py /tmp/qwen-tok $VLM \
        "$(dirname $DATA)" > "$OUT/make_vlm.log" 2>&1 ;;&
    encoder)
      timeout 200 python3 benchmarks/make_vlm_bench.py --encoder $VLM $DATA --out "$OUT/encoder.json" \
        > "$OUT/encoder.log" 2>&1; tail -3 "$OUT/encoder.log" ;;
    vs_trl)
      for run in ${RUNS:?RUNS=\"ours_vlm_1 trl_vlm_1 ...\"}; do
        case $run in
          ours_vlm_*) ours "$run" "${RUN_LIMIT:-330}" grpo.py $VLM_RUN --vllm-mode colocate --param-dtype bfloat16 \
            --no-freeze-vision-tower ${OURS_EXTRA:-} ;;
          trl_vlm_*) BENCH_MODEL=$VLM BENCH_DATA=$DATA trl "$run" "${RUN_LIMIT:-330}" ;;
        esac
      done
      timeout 60 python3 benchmarks/summarize.py ratios "$OUT" --commit "${COMMIT:-unknown}" ;;
    server)  # docs/vision.md's one-GPU server mode: an IPC server of the shape on this GPU, then grpo.py against it
      serve_ipc $VLM 8005 --gpu-memory-utilization 0.3 --max-model-len 4096 --limit-mm-per-prompt '{"image": 1}'
      wait_server 8005 300 && ours ours_vlm_server "${RUN_LIMIT:-330}" grpo.py $VLM_RUN --vllm-mode server \
        --vllm-server-port 8005 ${OURS_EXTRA:-}
      stop_servers "serve $VLM --port 8005" ;;
    *) echo "vision: VISION=tests, encoder, vs_trl or server, not $VISION" >&2; exit 2 ;;
  esac
fi
if [ "$PHASE" = lora15 ]; then  # bench-1.5b (make_bench_model.py TOK /tmp/bench-qwen15b 1.5b), full vs LoRA, colocate + sleep
  L="${BENCH//$MODEL//tmp/bench-qwen15b} --vllm-mode colocate --vllm-enable-sleep-mode"
  ours ours_full15 240 grpo.py $L
  ours ours_lora15 240 grpo.py $L --use-peft --lora-r 16 --lora-alpha 32
fi
if [ "$PHASE" = colocate ]; then
  setsid bash "$0" colocate_runs "$OUT" > "$OUT/colocate.out" 2>&1 < /dev/null &
fi
if [ "$PHASE" = colocate_runs ]; then
  C="${ADD/--vllm-mode server/--vllm-mode colocate --vllm-gpu-memory-utilization 0.07}"
  RUNS=(${COLOCATE_RUNS:-grpo_lora_colocate_lr1e-4:grpo:--use-peft,--learning-rate,1e-4
    grpo_lora_colocate_lr3e-4:grpo:--use-peft,--learning-rate,3e-4 rloo_lora_colocate:rloo:--use-peft,--learning-rate,2e-4
    online_dpo_lora_colocate:online_dpo:--use-peft,--learning-rate,2e-4})
  TURNS=$OUT/turns; mkdir -p "$TURNS"; export ENGINE_TURN_TIMEOUT=240 ENGINE_BARRIER_TIMEOUT=300 OMP_NUM_THREADS=2
  for i in "${!RUNS[@]}"; do
    IFS=: read -r name s extra <<< "${RUNS[$i]}"
    [ "$s" = online_dpo ] && n="--prompts-per-step 64 --num-generations 4" || n="--prompts-per-step 16 --num-generations 8"
    echo "== $name: python $s.py $C $n ${extra//,/ }" > "$OUT/$name.log"
    (
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29650 + i)) timeout "${LEARN_LIMIT:-540}" python3 benchmarks/engine_turns.py \
        "$TURNS" "$i" "${#RUNS[@]}" "$s.py" --output-dir "$OUT/$name" $C $n ${extra//,/ } >> "$OUT/$name.log" 2>&1
      echo "== $name exit $?" >> "$OUT/$name.log"
      touch "$TURNS/$i.ready"
      find "$OUT/$name" -mindepth 1 ! -name metrics.jsonl -delete
    ) &
  done
  wait
  echo "colocate runs done"
fi
if [ "$PHASE" = eval ]; then  # docs/evaluation.md (387eaf4: EVAL_BUDGET_S=440); about EVAL_BUDGET_S + 1 min
  [ -z "$(ls -A "$OUT")" ] || { echo "one_gpu.sh eval: $OUT is not empty: give a new folder" >&2; exit 2; }
  START=$(date +%s); END=$((START + ${EVAL_BUDGET_S:-480}))
  if [ "${EVAL_DRY_RUN:-0}" != 1 ] && command -v nvidia-smi > /dev/null; then  # the GPU must be (nearly) free
    Q="--query-gpu=memory.used,memory.total --format=csv,noheader,nounits"
    read -r used total <<< "$(timeout 30 nvidia-smi -i 0 $Q | tr -d ',')"
    echo "one_gpu.sh eval: ${used} of ${total} MiB in use before the runs"
    if [ "$((used * 4))" -gt "$total" ]; then  # the six runs need 6 x 0.07 for engines and ~35 GB for trainers
      timeout 30 nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv
      echo "one_gpu.sh eval: the GPU is taken (a \`vllm serve\` left there?): free it" >&2; exit 3
    fi
  fi
  export OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 ENGINE_TURN_TIMEOUT=240
  export ENGINE_BARRIER_TIMEOUT=$((${EVAL_BUDGET_S:-480} - 60))
  M=/tmp/smol STEPS=100 EVERY=25
  GEN="--use-vllm --vllm-mode colocate --vllm-gpu-memory-utilization ${EVAL_VLLM_MEM:-0.07}"
  if [ "${EVAL_DRY_RUN:-0}" = 1 ]; then  # stories260K, given a chat template for the task's chat-message prompts
    M=$OUT/dry_run_model STEPS=2 EVERY=1 GEN="--no-use-vllm --no-bf16" OMP_NUM_THREADS=1
    timeout 120 python3 -c "import shutil, sys, transformers as t
shutil.copytree('tests/assets/stories260K', sys.argv[1]); tok = t.AutoTokenizer.from_pretrained(sys.argv[1])
tok.chat_template = \"{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\"
tok.save_pretrained(sys.argv[1])" "$M" || exit 1
  fi
  # the issue's settings (16 prompts x 8 completions, 32 tokens, lr 1e-5, 100 steps); micro-batches of 4096 tokens
  # (the default 16384 gives the same gradients with a larger memory peak, and six trainers share the GPU here)
  E="--model-name-or-path $M --dataset-name /tmp/tasks/addition.jsonl --prompt-column prompt --answer-column answer
     --reward-funcs gsm8k_accuracy --max-completion-length 32 --learning-rate 1e-5 --max-steps $STEPS
     --micro-batch-tokens 4096 --eval-dataset /tmp/tasks/addition_eval.jsonl --eval-steps $EVERY --log-completions 2
     $GEN"
  E=$(echo $E)  # one line: each RUNS entry below is read as one line
  RUNS=("ours_grpo grpo.py $E --prompts-per-step 16 --num-generations 8"
    "ours_rloo rloo.py $E --prompts-per-step 16 --num-generations 8"
    "ours_online_dpo online_dpo.py $E --prompts-per-step 64 --num-generations 4 --temperature 1.0 --beta 0.1")
  if [ "${EVAL_DRY_RUN:-0}" != 1 ]; then
    for algo in grpo rloo online_dpo; do RUNS+=("trl_$algo benchmarks/trl_addition.py $algo $OUT/trl_$algo"); done
  fi
  TURNS=$(mktemp -d /tmp/eval_turns.XXXXXX)
  PIN=""; [ -n "${EVAL_CPUS:-}" ] && PIN="taskset -c $EVAL_CPUS"
  for i in "${!RUNS[@]}"; do  # all at once; engine_turns.py orders their engines' starts
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
    timeout 180 python3 benchmarks/plot.py "${DONE[@]}" --out "$OUT/plots" > /dev/null || echo "eval: plot.py failed"
    timeout 60 python3 benchmarks/summarize.py runs "${DONE[@]}" --out "$OUT/addition_eval.json" \
      ${EVAL_COMMIT:+--commit $EVAL_COMMIT} || echo "eval: summarize.py failed"
    timeout 60 python3 benchmarks/plot.py --summary "$OUT/addition_eval.json" --out "$OUT/plots" > /dev/null ||
      echo "eval: plot.py --summary failed"
  fi
  (cd "$OUT" && timeout 120 tar czf eval_runs.tgz --exclude=eval_runs.tgz ./*)
  echo "one_gpu.sh eval: done in $(( $(date +%s) - START )) s"
fi
