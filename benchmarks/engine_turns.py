"""Run a training script so that colocated vLLM engines sharing one GPU start one at a time, and all of them before any
process trains (`benchmarks/one_gpu.sh eval` runs six such processes on one GPU, its `colocate` phase four).

    python3 benchmarks/engine_turns.py TURN_DIR INDEX COUNT SCRIPT [ARGS ...]

Why: a starting engine sizes its KV cache from the GPU's free memory, measured before and after its profiling run
(vllm/v1/worker/gpu_worker.py, determine_available_memory): memory another process takes meanwhile is counted as
this engine's own (a smaller or negative KV cache: "No available memory for the cache blocks"), and memory another
process frees meanwhile fails the start ("Error in memory profiling ... other processes sharing the same container
release GPU memory"). Another engine's own start frees memory (profiling ends with torch.cuda.empty_cache()), and a
training step takes it.

How: process INDEX waits until TURN_DIR/<INDEX-1>.ready exists before it runs SCRIPT (heavy imports are done first,
while waiting), so everything up to its engine's start happens in its turn; vllm.LLM.__init__ is wrapped to write
TURN_DIR/<INDEX>.ready once the engine is up, then to wait until all COUNT engines are ready before the script goes
on. The caller writes <INDEX>.ready when the process has exited, so that a run that dies before its engine is up
holds up nobody (and the next engine starts only after the dead one's memory is back). Waits give up after $ENGINE_TURN_TIMEOUT s (default 300) for the turn and
$ENGINE_BARRIER_TIMEOUT s (default 600) for the others, with a warning, and the run goes on. $ENGINE_TURNS_PREIMPORT
lists the modules imported before the turn (default torch,transformers; vllm is always imported when installed).
"""

import functools
import importlib
import os
import runpy
import sys
import time


def ready_file(turns, index):
    return os.path.join(turns, f"{index}.ready")


def wait_for(paths, timeout, what):
    """Wait until every path exists (True), or give up after `timeout` seconds with a warning (False)."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            print(f"engine_turns: gave up waiting for {what} after {timeout:.0f} s; going on", flush=True)
            return False
        time.sleep(0.25)
    return True


def main(argv):
    if len(argv) < 4:
        sys.exit("usage: python3 benchmarks/engine_turns.py TURN_DIR INDEX COUNT SCRIPT [ARGS ...]")
    turns, index, count, script, args = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4:]
    turn_timeout = float(os.environ.get("ENGINE_TURN_TIMEOUT", "300"))
    barrier_timeout = float(os.environ.get("ENGINE_BARRIER_TIMEOUT", "600"))
    for name in os.environ.get("ENGINE_TURNS_PREIMPORT", "torch,transformers").split(","):
        if name:  # imports touch no GPU: do them before the turn
            importlib.import_module(name)
    try:
        import vllm
    except ImportError:  # no vLLM (one_gpu.sh eval's CPU dry run): no engines, no turns
        vllm = None
    if vllm is not None:
        start_engine = vllm.LLM.__init__

        @functools.wraps(start_engine)
        def init(self, *a, **kw):
            t0 = time.monotonic()
            start_engine(self, *a, **kw)  # if it fails, the caller writes the ready file once this process is gone
            open(ready_file(turns, index), "w").close()
            print(f"engine_turns: engine {index} started in {time.monotonic() - t0:.0f} s", flush=True)
            t0 = time.monotonic()
            wait_for([ready_file(turns, i) for i in range(count)], barrier_timeout, "the other engines")
            print(f"engine_turns: all {count} engines ready after {time.monotonic() - t0:.0f} s more", flush=True)

        vllm.LLM.__init__ = init
    if index > 0 and vllm is not None:
        t0 = time.monotonic()
        wait_for([ready_file(turns, index - 1)], turn_timeout, f"engine {index - 1}")
        print(f"engine_turns: turn {index} after {time.monotonic() - t0:.0f} s", flush=True)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python3 SCRIPT` would have it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
