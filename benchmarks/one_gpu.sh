#!/usr/bin/env bash
# Server mode on ONE GPU (a `vllm serve --weight-transfer-config '{"backend": "ipc"}'` beside the trainer on its own
# GPU, weights pushed as CUDA IPC handles), on a 1 x H200 host prepared by ../shared/gpu/README.md (source
# .gpu/setup.sh first; TRL 1.16 on the path). Each phase fits one 10-minute device call.
# Usage: bash benchmarks/one_gpu.sh PHASE OUT_DIR (the phases below); then python benchmarks/ratios.py OUT_DIR
#   serve: starts the compiled bench-0.5b IPC server (port 8001) in its own session: it outlives the call, and boots
#          while later calls bring the rest of the payload. A fixed KV cache: the GPU fills up beside it.
#   check: starts the bench-0.5b server unless it runs, the learning runs of $RUNS (the addition task with
#          SmolLM2-135M-Instruct, 100 steps; by default the three scripts against their own eager IPC servers, grpo.py
#          also with --async-generation and with --use-peft: all share the GPU),
#          and tests/gpu/test_server_ipc.py (the sync check for the two tiny MoE models, then bench-0.5b once its
#          server is up).
#   two_servers: tests/gpu/test_server_ipc.py's two-server test (one push to both, both compared with the trainer).
#   bench: bench-0.5b side by side, PAIR=1: TRL colocate, ours colocate, ours one-GPU server, ours one-GPU server
#          --async-generation; PAIR=2 the same in reverse order. Writes OUT_DIR/vs_trl.json (ratios.py, $COMMIT).
#          SERVERS=2: ours against two servers on the GPU (ports 8001 and 8011), each round shared between them.
#          SIDES: which of trl, colocate, server and async run (all four by default), in PAIR=1's order;
#          async_one: --async-generation against the first server only (with SERVERS=2: one server against two).
#          BENCH_MODEL=/tmp/bench-qwen15b (../shared/gpu/make_bench_model.py TOK OUT 1.5b) for the 1.5B shape: its
#          server is started on port 8002 (stop the 0.5b one first: both would not fit beside a trainer).
#          MPS=1: the servers (ports 8061 / 8062 and on) and the trainers of the server sides are clients of a CUDA
#          MPS daemon (started here: nvidia-cuda-mps-control -d, pipe /tmp/mps/pipe), so that their kernels can run at
#          once instead of taking turns on the GPU; TRL and our colocate runs stay outside it (a process finds no daemon
#          at the default pipe). ASYNC_FLAGS: more flags for the async sides (e.g. --micro-batch-tokens 32768).
#   mps_stop: stops the MPS=1 bench servers of BENCH_MODEL, then the MPS daemon.
#   push_probe: where a push to the bench servers goes, call by call (benchmarks/push_probe.py; SERVERS as bench).
#   learn: the learning runs of $RUNS against eager IPC servers of their own (by default grpo.py against two servers,
#          with and without --async-generation), in a session of their own: give it a directory that outlives the
#          call (/root/learn); OUT_DIR/learn.out says when done.
#   colocate: the learning runs of $COLOCATE_RUNS, colocated (vLLM at 0.07 each; by default the three scripts with
#          --use-peft, grpo.py at two learning rates), in a session of their own: the call returns at once, the runs
#          go on (benchmarks/engine_turns.py starts their engines one at a time); OUT_DIR/colocate.out says when done.
#   ab:    colocate bench-0.5b, $OLD_DIR's grpo.py (an older commit's scripts: git show C:grpo.py > bench_old/grpo.py,
#          the same for vllm_utils.py and rewards.py; bench_old/ is ignored: carry it) then ours (PAIR=1), or the reverse.
#   faults: tests/gpu/test_faults_ipc.py (trainers killed inside a push, the server killed inside one); FAULT_K=test_4
#          runs one test; everything comes back as OUT_DIR/faults.tgz.
#   rounds_profile: py-spy of the server's processes during rounds with and without log-probs, then the server's rounds
#          against a server of leaner flags (d) and the in-process engine; OUT_DIR/profile.tgz. Its servers boot
#          while earlier calls run if the phase profile_servers started them (SERVER_LOGS=/root/srv in both calls).
#   rounds: the bench-0.5b round on the server (port 8001, started unless it runs) against the in-process engine of
#          colocate mode, alternating round by round, each alone at work (benchmarks/server_gen.py, ALTERNATE=1).
#   rounds_flags: the same against servers of other flags (--skip-tokenizer-init, the in-process scheduler limits)
#          and against requests without log-probs: where the server's extra time goes.
#   lora7b: LoRA (r 16, alpha 32, every linear layer) on the random-init Qwen2.5-7B shape (/tmp/bench-qwen7b:
#          make_bench_model.py TOK /tmp/bench-qwen7b 7b), colocate with sleep mode, the bench workload: PAIR=1 ours
#          then TRL 1.16 (LORA_R=16 SLEEP=1), PAIR=2 the reverse; SIDES=trl_memory: ours at TRL's memory settings.
#          No other vLLM may hold memory (stop the servers).
#   lora15: bench-1.5b (/tmp/bench-qwen15b), ours full fine-tuning then LoRA, colocate with sleep mode.
#   saved_bytes: what a LoRA training forward of the 7B width saves per token on this GPU (benchmarks/saved_bytes.py).
#   lora_compile: bench-1.5b with --use-peft, eager then with its decoder layers compiled (PAIR=2: the reverse).
set -u
PHASE=$1; OUT=$2; mkdir -p "$OUT"
# a bare host (lost between calls, or a call that ran before the payload's) fails now, not after a server's timeout
python3 -c "import vllm" 2> /dev/null || { echo "one_gpu.sh: no vllm here: transfer the payload, source .gpu/setup.sh" >&2; exit 3; }
[ -f /tmp/tasks/addition.jsonl ] || python3 benchmarks/make_tasks.py /tmp/tasks > /dev/null  # once: runs of other calls read it
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
  python3 tests/gpu/make_tiny_models.py /tmp/tiny-models > "$OUT/make_tiny.log" 2>&1 && touch /tmp/tiny-models/made
}
stop_servers() {  # stop_servers REGEX: each `vllm serve` whose command line matches, with its session (front ends,
  # EngineCore); a pattern, not "every server": another phase's servers may be running
  local pid sid
  for pid in $(pgrep -f "$1"); do
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    [ -n "$sid" ] && kill -- -"$sid"
  done
}
wait_server() { python3 -c "import vllm_utils; vllm_utils.wait_for_server('http://127.0.0.1:$1', ${2:-600}, 'server')"; }
ours() {  # ours NAME TIMEOUT SCRIPT ARGS...
  local name=$1 limit=$2 script=$3; shift 3
  echo "== $name: python $script $*" > "$OUT/$name.log"
  eval timeout "$limit" env ${RUN_ENV:-} python3 "$script" --output-dir "$OUT/$name" "$@" >> "$OUT/$name.log" 2>&1
  echo "== $name exit $?" | tee -a "$OUT/$name.log"
  find "$OUT/$name" -mindepth 1 ! -name metrics.jsonl -delete  # a device call returns at most 8 files: keep this one
}
trl() {  # trl NAME TIMEOUT (BENCH_MODEL reaches trl_bench.py through the environment)
  echo "== $1: trl_bench.py colocate ${BENCH_MODEL:-}" > "$OUT/$1.log"
  timeout "$2" python3 benchmarks/trl_bench.py colocate "$OUT/$1" >> "$OUT/$1.log" 2>&1
  echo "== $1 exit $?" | tee -a "$OUT/$1.log"
}

MODEL=${BENCH_MODEL:-/tmp/bench-qwen05b}; PORT=8001; [ "$MODEL" != /tmp/bench-qwen05b ] && PORT=8002
BENCH="${BENCH/\/tmp\/bench-qwen05b/$MODEL}"
MPS_ENV=""  # MPS=1 (bench, serve, push_probe, mps_stop): see the header
case "$PHASE:${MPS:-0}" in
  bench:*|serve:*|push_probe:*|mps_stop:1) ;;
  mps_stop:*) echo "one_gpu.sh: mps_stop needs MPS=1 (and the servers' BENCH_MODEL / SERVERS)" >&2; exit 2 ;;
  *:1) echo "one_gpu.sh: MPS=1 applies to bench, serve, push_probe and mps_stop only, not $PHASE" >&2; exit 2 ;;
esac
if [ "${MPS:-0}" = 1 ]; then
  MPS_ENV="CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log"; PORT=$((PORT + 60))
  command -v nvidia-cuda-mps-control > /dev/null || { echo "one_gpu.sh: no nvidia-cuda-mps-control" >&2; exit 4; }
  mkdir -p /tmp/mps/pipe /tmp/mps/log
  if [ "$PHASE" != mps_stop ] && ! echo get_server_list | env $MPS_ENV nvidia-cuda-mps-control > /dev/null 2>&1
  then
    env $MPS_ENV nvidia-cuda-mps-control -d || { echo "one_gpu.sh: the MPS daemon did not start" >&2; exit 4; }
  fi
fi
# SERVERS=2: two bench servers (ports PORT and PORT + 10) that the trainer shares each round between
PORTS=$(seq -s ' ' $PORT 10 $((PORT + 10 * (${SERVERS:-1} - 1))))
serve_bench() {  # compiled, as a user's server would be; $SERVE_FLAGS: more flags (e.g. what rounds_profile found)
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
  local i=0 trainers="" r name s mode extra servers n ports port pid
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
  stop_servers "serve /tmp/smol --port 81[0-9][0-9]"  # these runs' servers only (the fault tests' is on 8041)
  python3 benchmarks/summarize.py "$OUT" > "$OUT/learn_summary.txt" 2>&1; cat "$OUT/learn_summary.txt"
}
sync_tests() {
  tiny_models
  GPU_RESULTS_DIR=$OUT VLLM_TEST_BENCH_URL=http://127.0.0.1:8001 timeout 500 python3 -m pytest -x -q -rs \
    tests/gpu/test_server_ipc.py 2>&1 | tee "$OUT/pytest_ipc.log"
}

profile_servers() {  # rounds_profile's servers: a (the scripts' flags), d (leaner flags) and d's twin; the phase
  # profile_servers starts them a call early (with SERVER_LOGS set: their logs outlive that call)
  local KV="--gpu-memory-utilization 0.2 --kv-cache-memory-bytes 8589934592 --max-model-len 2048 --api-server-count 4"
  local D="--skip-tokenizer-init --max-num-batched-tokens 16384 --max-num-seqs 256 --disable-log-stats"
  serve_ipc "$MODEL" 8007 $KV
  serve_ipc "$MODEL" 8003 $KV $D
  serve_ipc "$MODEL" 8005 $KV $D  # d's twin: split shares each round between the two
}

[ "$PHASE" = serve ] && serve_bench
[ "$PHASE" = profile_servers ] && profile_servers
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
if [ "$PHASE" = two_servers ]; then  # one push to two IPC servers of the tiny DeepSeek-V2 model, both compared
  tiny_models
  GPU_RESULTS_DIR=$OUT timeout 400 python3 -m pytest -x -q -rs tests/gpu/test_server_ipc.py -k two_ipc 2>&1 \
    | tee "$OUT/pytest_two_servers.log"
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
  serve_bench; for p in $PORTS; do wait_server "$p"; done
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
  python3 benchmarks/ratios.py "$OUT" --commit "${COMMIT:-unknown}" --model "$MODEL"
fi
if [ "$PHASE" = push_probe ]; then  # each HTTP call of a push to the bench servers, one and all (push_probe.py)
  for p in $PORTS; do wait_server "$p"; done
  timeout 300 env $MPS_ENV python3 benchmarks/push_probe.py "$MODEL" "$OUT/push_probe.json" $PORTS 2>&1 | tail -5
fi
if [ "$PHASE" = mps_stop ]; then  # the MPS=1 bench servers of this model, then the daemon (it waits for its clients)
  stop_servers "serve $MODEL --port ($(echo $PORTS | tr ' ' '|'))"; sleep 5
  echo quit | env $MPS_ENV nvidia-cuda-mps-control; echo "== mps_stop exit $?"
fi
if [ "$PHASE" = ab ]; then  # colocate bench-0.5b, the scripts of $OLD_DIR (e.g. bench_old/, carried) against these
  P=${PAIR:-1}
  old() { echo "== old_$1: $OLD_DIR/grpo.py" > "$OUT/old_$1.log"; (cd "$OLD_DIR" && eval timeout 230 python3 grpo.py \
    --output-dir "$OUT/old_$1" $BENCH --vllm-mode colocate >> "$OUT/old_$1.log" 2>&1); echo "== old_$1 exit $?"
    find "$OUT/old_$1" -mindepth 1 ! -name metrics.jsonl -delete; }  # at most 8 files come back
  if [ "$P" = 1 ]; then old 1; ours new_1 230 grpo.py $BENCH --vllm-mode colocate
  else ours new_2 230 grpo.py $BENCH --vllm-mode colocate; old 2; fi
fi
if [ "$PHASE" = rounds ]; then
  serve_bench; wait_server $PORT
  ALTERNATE=1 VARIANTS=completions-8,inprocess timeout 400 python3 benchmarks/server_gen.py $PORT "$OUT/rounds.json" \
    "${ROUNDS:-7}" > "$OUT/rounds.log" 2>&1
  echo "== rounds exit $?"; tail -3 "$OUT/rounds.log"
fi
if [ "$PHASE" = rounds_flags ]; then  # where the server's round loses to the in-process one: three servers, one each
  # of serve_bench's flags (a), with --skip-tokenizer-init (b: no detokenizing in the front ends; the requests are
  # token ids and return_tokens_as_token_ids already), and b with the in-process engine's scheduler limits (c);
  # alternated with the in-process engine and with a's requests without log-probs
  # (ports of their own: a `serve` phase's server on 8001 has other memory flags). Stopped at the end.
  KV="--gpu-memory-utilization 0.2 --kv-cache-memory-bytes 8589934592 --max-model-len 2048 --api-server-count 4"
  serve_ipc "$MODEL" 8007 $KV
  serve_ipc "$MODEL" 8003 $KV --skip-tokenizer-init
  serve_ipc "$MODEL" 8005 $KV --skip-tokenizer-init --max-num-batched-tokens 16384 --max-num-seqs 256
  wait_server 8007; wait_server 8003; wait_server 8005
  V=completions-8,b:completions-8,c:completions-8,inprocess,completions-8-nologprobs
  OTHER_PORTS=b=8003,c=8005 ALTERNATE=1 VARIANTS=$V timeout 400 python3 benchmarks/server_gen.py 8007 \
    "$OUT/rounds_flags.json" "${ROUNDS:-5}" > "$OUT/rounds_flags.log" 2>&1
  echo "== rounds_flags exit $?"; tail -6 "$OUT/rounds_flags.log"
  stop_servers "serve $MODEL --port (8007|8003|8005)"
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
  python3 benchmarks/ratios.py "$OUT" --commit "${COMMIT:-unknown}" --model "$MODEL"
fi
if [ "$PHASE" = lora15 ]; then  # bench-1.5b (make_bench_model.py TOK /tmp/bench-qwen15b 1.5b), full vs LoRA, colocate + sleep
  L="${BENCH//$MODEL//tmp/bench-qwen15b} --vllm-mode colocate --vllm-enable-sleep-mode"
  ours ours_full15 240 grpo.py $L
  ours ours_lora15 240 grpo.py $L --use-peft --lora-r 16 --lora-alpha 32
fi
if [ "$PHASE" = saved_bytes ]; then  # the 7B width's saved activations per token on this GPU (~30 s; CPU: 6.02 MB)
  timeout 300 python3 benchmarks/saved_bytes.py cuda sdpa eager 2>&1 | tee "$OUT/saved_bytes.txt"
fi
if [ "$PHASE" = lora_compile ]; then  # bench-1.5b --use-peft, eager against compiled (benchmarks/lora_compile.py)
  [ -f /tmp/bench-qwen15b/config.json ] || python3 .gpu/make_bench_model.py /tmp/qwen-tok /tmp/bench-qwen15b 1.5b
  L="${BENCH//$MODEL//tmp/bench-qwen15b} --vllm-mode colocate --vllm-enable-sleep-mode --use-peft --lora-r 16 --lora-alpha 32"
  P=${PAIR:-1}; [ "$P" = 1 ] && ORDER="eager compiled" || ORDER="compiled eager"
  for side in $ORDER; do
    [ "$side" = eager ] && ours lora15_eager_$P 240 grpo.py $L || ours lora15_compiled_$P 240 benchmarks/lora_compile.py grpo.py $L
  done
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
if [ "$PHASE" = faults ]; then  # FAULT_K: a pytest -k expression (e.g. test_4: each test boots servers of its own)
  tiny_models
  GPU_RESULTS_DIR=$OUT timeout "${FAULT_LIMIT:-560}" python3 -m pytest -q -rs ${FAULT_K:+-k "$FAULT_K"} \
    tests/gpu/test_faults_ipc.py 2>&1 | tee "$OUT/pytest_faults_ipc.log"
  tail -5 "$OUT/failures.txt" 2>/dev/null
  # a device call brings back 8 files: the servers' logs and every report travel as one archive
  tar -czf /tmp/faults.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/faults.tgz "$OUT/"
fi
if [ "$PHASE" = rounds_profile ]; then  # where a server round's CPU time goes, and one candidate fix (~5 min)
  # py-spy (.gpu/bin/py-spy: the binary of `pip download py-spy`'s wheel) samples every process of server a (the
  # scripts' flags) during rounds with and without log-probs; then a's rounds alternate with server d's (a with
  # --skip-tokenizer-init, the in-process engine's scheduler limits and no stats logging), with each round shared by d
  # and its twin at once (split: two EngineCores on the one GPU), and with the in-process engine's
  [ -x .gpu/bin/py-spy ] || echo "rounds_profile: no .gpu/bin/py-spy, so no profiles (on a machine with PyPI: pip download \
--no-deps py-spy, unzip the wheel, copy its py_spy-*.data/scripts/py-spy to .gpu/bin/ and carry it)"
  profile_servers; wait_server 8007; wait_server 8003; wait_server 8005
  # each thread's active samples, with and without log-probs; then (--gil) only the thread holding the GIL: whether
  # the EngineCore's output thread (msgpack of the log-prob arrays) takes it from the scheduling loop
  for spec in completions-8: completions-8-nologprobs: completions-8:--gil; do
    v=${spec%%:*}; gil=${spec#*:}; name=$v${gil:+-gil}
    VARIANTS=$v timeout 120 python3 benchmarks/server_gen.py 8007 "$OUT/spy_$name.json" 8 > "$OUT/spy_$name.log" 2>&1 &
    gen=$!; sleep 8  # past the warm-up round
    timeout 60 .gpu/bin/py-spy record --subprocesses --threads --nonblocking $gil -r 100 -d 12 -f raw \
      -o "$OUT/spy_$name.txt" -p "$(pgrep -f "serve $MODEL --port 8007" | head -1)" > "$OUT/spy_$name.err" 2>&1
    wait $gen
  done
  python3 benchmarks/spy_summary.py "$OUT"/spy_*.txt > "$OUT/spy_summary.txt" 2>&1; head -c 6000 "$OUT/spy_summary.txt"
  OTHER_PORTS=d=8003 SPLIT_PORTS=8003,8005 ALTERNATE=1 VARIANTS=completions-8,d:completions-8,split,inprocess \
    timeout 300 python3 benchmarks/server_gen.py 8007 "$OUT/rounds_d.json" "${ROUNDS:-5}" > "$OUT/rounds_d.log" 2>&1
  echo "== rounds_d exit $?"; grep '"median_s"' "$OUT/rounds_d.log"
  stop_servers "serve $MODEL --port (8007|8003|8005)"
  [ -n "${SERVER_LOGS:-}" ] && cp "$SERVER_LOGS"/server_800[357].log "$OUT"/ 2>/dev/null
  tar -czf /tmp/profile.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/profile.tgz "$OUT/"
fi
