"""grpo.py itself (run with runpy), except that the trainer touches the file $FAULT_MARKER once its weight push number
$FAULT_PUSH (default 3) has sent its first /update_weights: tests/gpu/test_faults_ipc.py then kills the server while
that push is still going (1 MiB chunks make it a few seconds long). Usage: python tests/gpu/grpo_marked.py GRPO_ARGS..."""

import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
import vllm_utils  # noqa: E402

post, pushes = vllm_utils._post, []


def marked_post(base_url, path, timeout, **kwargs):
    if path == "/start_weight_update":
        pushes.append(path)
    out = post(base_url, path, timeout, **kwargs)
    marker = os.environ["FAULT_MARKER"]
    if (
        path == "/update_weights"
        and len(pushes) == int(os.environ.get("FAULT_PUSH", "3"))
        and not os.path.exists(marker)
    ):
        open(marker, "w").close()
    return out


vllm_utils._post = marked_post  # grpo.py's `import vllm_utils` finds this module, patched
sys.argv = [os.path.join(ROOT, "grpo.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
