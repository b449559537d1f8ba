"""Build the two tiny random-init models of the real-model GPU tests (transformers only, no download), in bf16:

  MODEL_DIR/tiny-dsv2      DeepSeek-V2-shaped (V2-Lite layout): MLA attention with q_lora_rank None, kv_lora_rank 512,
                           qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128 (DeepSeek's own values: FlashMLA,
                           vLLM's default MLA backend on Hopper, takes only the 576-wide latent (512 + 64) cache, and
                           every other MLA backend takes it too); 3 layers, the first dense, then MoE (8 routed experts,
                           top-2, 1 shared, greedy softmax routing with n_group = topk_group = 1 as V2-Lite).
  MODEL_DIR/tiny-qwen3moe  Qwen3-MoE-shaped: 3 layers, GQA 8 query / 4 KV heads of 64, 8 experts, top-2.

Both have 8 attention heads (and 4 KV heads), so tensor parallel 2 divides them. Why these models matter for the
weight sync: vLLM derives tensors from the checkpoint's at load time (MLA: W_UK_T / W_UV split out of kv_b_proj in
process_weights_after_loading; MoE: the experts stacked into w13/w2), and transformers 5 keeps the MoE experts fused
(mlp.experts.gate_up_proj, one 3-D tensor) while the saved checkpoint has them per expert (mlp.experts.0.gate_proj).
Tokenizer: copied from --tokenizer (default /tmp/smol, SmolLM2's, vocab 49152; /tmp/bench-qwen05b also works).

Usage: python tests/gpu/make_tiny_models.py MODEL_DIR [--tokenizer DIR]"""

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config, Qwen3MoeConfig


def configs(vocab_size, bos, eos):
    common = dict(vocab_size=vocab_size, hidden_size=512, num_hidden_layers=3, num_attention_heads=8)
    common.update(max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    common.update(bos_token_id=bos, eos_token_id=eos)
    dsv2 = DeepseekV2Config(
        **common,
        num_key_value_heads=8,
        intermediate_size=1024,
        moe_intermediate_size=256,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        scoring_func="softmax",
    )
    qwen = Qwen3MoeConfig(
        **common,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return {"tiny-dsv2": dsv2, "tiny-qwen3moe": qwen}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--tokenizer", default="/tmp/smol")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = max(len(tokenizer), tokenizer.vocab_size)
    vocab += -vocab % 64  # a multiple of 64, as real checkpoints pad it
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    for seed, (name, config) in enumerate(configs(vocab, bos, eos).items()):
        out = os.path.join(args.model_dir, name)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"model": out, "architectures": config.architectures, "params": params, "vocab": vocab}))


if __name__ == "__main__":
    main()
