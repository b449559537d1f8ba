"""Run under `torchrun --nproc_per_node 4` (gloo): two tensor-parallel groups of 2 ranks. Each group's engine (a fake
that answers every prompt with its own first token) must see the prompts of both its ranks, and every rank must get
back exactly the completions of its own prompts, also when the ranks hold different numbers of prompts."""

import os
import sys
from types import SimpleNamespace

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import vllm_utils  # noqa: E402


class EchoLLM:
    def __init__(self):
        self.seen = []

    def generate(self, prompts, params, use_tqdm=False):
        from vllm.logprobs import Logprob, create_sample_logprobs

        self.seen.append([p["prompt_token_ids"] for p in prompts])

        def sample(first, k):  # tokens [first, k] with log-probs -1, -2, as vLLM's engine builds them
            logprobs = create_sample_logprobs(params.flat_logprobs)
            for token, value in ((first, -1.0), (k, -2.0)):
                logprobs.append({token: Logprob(logprob=value, rank=1, decoded_token=None)})
            return SimpleNamespace(token_ids=[first, k], logprobs=logprobs)

        return [
            SimpleNamespace(outputs=[sample(p["prompt_token_ids"][0], k) for k in range(params.n)]) for p in prompts
        ]


dist.init_process_group("gloo")
rank = dist.get_rank()
group = vllm_utils.tensor_parallel_group(2)
llm = EchoLLM()
engine = {
    "mode": "colocate",
    "llm": llm,
    "tp_group": group,
    "n": 3,
    "fields": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 2},
}
prompts = [[100 * rank + i, 5] for i in range(rank + 1)]  # rank r holds r + 1 prompts
ids, lps = vllm_utils.generate(engine, prompts)
assert ids == [[p[0], k] for p in prompts for k in range(3)], (rank, ids)
assert lps == [[-1.0, -2.0]] * len(ids)
partner = rank ^ 1  # the other rank of this group: ranks (0, 1) and (2, 3)
low, high = min(rank, partner), max(rank, partner)
assert llm.seen == [[[100 * r + i, 5] for r in (low, high) for i in range(r + 1)]], (rank, llm.seen)
dist.barrier()
if rank == 0:
    print("TP ROUTING OK", file=sys.stderr)
dist.destroy_process_group()
