"""A/B probe, not a feature: one of the scripts with --use-peft and its decoder layers torch.compile'd, as the scripts
compile the full model's (they leave LoRA uncompiled, unmeasured). Runs the script's own train() with add_lora wrapped:

    python benchmarks/lora_compile.py grpo.py --use-peft ...   (the script's flags; compare with `python grpo.py ...`)

(the script's own warning that --torch-compile is off with --use-peft still prints: this wrapper compiles them). On the
CPU the compiled LoRA layers matched the eager ones within bf16 rounding (log-probs 0.002 on a tiny Qwen2)."""

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
name = next(arg for arg in sys.argv[1:] if arg.endswith(".py"))  # the script, anywhere among the flags
script = importlib.import_module(os.path.basename(name).removesuffix(".py"))
add_lora = script.add_lora


def add_compiled_lora(*args, **kwargs):
    model = add_lora(*args, **kwargs)
    for layer in script.decoder_layers(model):  # one graph per layer type, as set_up compiles a full model's
        layer.forward = torch.compile(layer.forward, dynamic=True)
    print(f"lora_compile: {len(script.decoder_layers(model))} decoder layers compiled with their LoRA adapters")
    return model


script.add_lora = add_compiled_lora  # set_up finds add_lora in the script's module
script.train(script.parse_args([arg for arg in sys.argv[1:] if arg != name]))
