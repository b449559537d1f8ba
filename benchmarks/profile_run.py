"""Where the trainer's GPU time goes: run a training script under torch.profiler and print its kernels by total time.
Usage (GPU host): python benchmarks/profile_run.py OUT.txt grpo.py ARGS...   (use a few --max-steps: all are profiled;
in server mode the server is another process, so what is listed is the trainer's own work)."""

import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

out, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.getcwd())  # the scripts import rewards / vllm_utils from the repo root
sys.argv = sys.argv[2:]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    runpy.run_path(script, run_name="__main__")
table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
open(out, "w").write(table)
print(table)
