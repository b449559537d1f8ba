"""What a training forward saves for its backward, per token: the Qwen2.5-7B shape's width (hidden 3584, intermediate
18944, 28 heads / 4 KV heads) at 1 and 2 decoder layers, with --use-peft's LoRA (r 16, every linear layer) under bf16
autocast, through the scripts' own per_token_logprobs on a collate batch of the bench's rows (75 + 256 tokens).
Prints bytes per token per layer, the 28-layer estimate, and the largest saved tensors by shape and dtype.
The 7B LoRA run held ~11 MB a token on an H200 (benchmarks/results/README.md); this counts 6.05 on the CPU (sdpa),
and 6.02 on the H200 at 147e70e: the rest of what the pass holds is not saved activations.

    python benchmarks/saved_bytes.py [cuda|cpu] [sdpa|eager ...]"""

import collections
import os
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402

SHAPE = dict(vocab_size=2048, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)


def saved(layers, attention, device, rows=8):
    """(bytes saved per token, {(shape, dtype): bytes}) of one forward, each storage once, the weights left out."""
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, num_hidden_layers=layers)
    config._attn_implementation = attention
    base = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model = grpo.add_lora(grpo.Args(use_peft=True), base, torch.float32, autocast=True).to(device)
    completions = [[7] * 256] * (rows - 1) + [[7] * 200]  # one shorter row: padding, as in a real micro-batch
    batch = grpo.collate([[5] * 75] * rows, completions, torch.device(device), 0)
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}
    storages, groups = {}, collections.Counter()

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in storages:
            storages[ptr] = tensor.untyped_storage().nbytes()
            groups[(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))] += storages[ptr]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast(device, torch.bfloat16, cache_enabled=False):
            grpo.per_token_logprobs(model, *batch, with_entropy=True, into_grad=True)
    return sum(storages.values()) / batch[0].numel(), groups


def main(device=None, *attentions):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for attention in attentions or ("sdpa", "eager"):
        one, _ = saved(1, attention, device)
        two, groups = saved(2, attention, device)
        layer = two - one
        print(
            f"{device} {attention}: {layer / 1024:.1f} KB a token a layer, {(one - layer) / 1024:.1f} KB outside the "
            f"layers: {(28 * layer + one - layer) / 2**20:.2f} MB a token for 28 layers"
        )
        for (shape, dtype), size in groups.most_common(8):
            print(f"  {size / 2**20:8.1f} MiB  {dtype:8} {shape}")


if __name__ == "__main__":
    main(*sys.argv[1:])
