"""benchmarks/trl_addition.py cannot run without a GPU and TRL; this checks it against TRL 1.16's source instead: every
config key it passes is a field of the config dataclass (or of transformers' TrainingArguments, which TRL's configs
extend), every trainer keyword is a parameter of the trainer's __init__, and the names it imports exist. The source
is read, not imported: .gpu/extra/trl (the GPU payload, git-ignored) or $TRL_SOURCE; those tests skip without it."""

import ast
import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from grpo_cli import ROOT

TRL = Path(os.environ.get("TRL_SOURCE", ROOT / ".gpu" / "extra" / "trl"))
needs_trl = pytest.mark.skipif(not (TRL / "trainer" / "grpo_config.py").exists(), reason=f"no TRL source at {TRL}")

spec = importlib.util.spec_from_file_location("trl_addition", ROOT / "benchmarks" / "trl_addition.py")
trl_addition = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trl_addition)  # imports only the standard library at module level

# config class, its file, the trainer's file and class, as trl_addition.py imports them
CLASSES = {
    "grpo": ("GRPOConfig", "trainer/grpo_config.py", "trainer/grpo_trainer.py", "GRPOTrainer"),
    "rloo": ("RLOOConfig", "trainer/rloo_config.py", "trainer/rloo_trainer.py", "RLOOTrainer"),
    "online_dpo": (
        "OnlineDPOConfig",
        "experimental/online_dpo/online_dpo_config.py",
        "experimental/online_dpo/online_dpo_trainer.py",
        "OnlineDPOTrainer",
    ),
}


def find_class(path, name):
    tree = ast.parse((TRL / path).read_text())
    return next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)


def class_fields(path, name):
    """(annotated field names, base class names) of a dataclass in TRL's source."""
    node = find_class(path, name)
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return fields, [ast.unparse(base) for base in node.bases]


def config_fields(config, path):
    """Every field of a TRL config: its own, _BaseConfig's, and transformers.TrainingArguments' (the host's
    transformers 5.17, as here)."""
    from transformers import TrainingArguments

    own, bases = class_fields(path, config)
    assert bases == ["_BaseConfig"], bases
    base, base_bases = class_fields("trainer/base_config.py", "_BaseConfig")
    assert base_bases == ["TrainingArguments"], base_bases
    return own | base | {f.name for f in dataclasses.fields(TrainingArguments)}


@needs_trl
@pytest.mark.parametrize("algo", trl_addition.ALGOS)
def test_config_keys_exist_in_trl_1_16(algo, tmp_path):
    config, config_path, trainer_path, trainer = CLASSES[algo]
    keys = trl_addition.configs(algo, str(tmp_path))
    unknown = set(keys) - config_fields(config, config_path)
    assert not unknown, f"not fields of TRL 1.16's {config}: {unknown}"
    assert keys["learning_rate"] == 1e-5 and keys["max_steps"] == 100 and keys["logging_steps"] == 1
    if algo == "online_dpo":
        assert keys["per_device_train_batch_size"] == 64 and keys["max_new_tokens"] == 32  # x 2 completions (fixed)
    else:  # 16 prompts x 8 completions per optimizer step
        assert keys["per_device_train_batch_size"] * keys["gradient_accumulation_steps"] == 16 * 8
        assert keys["num_generations"] == 8 and keys["max_completion_length"] == 32
    # the trainer takes the keywords trl_addition.py passes
    init = next(
        n for n in find_class(trainer_path, trainer).body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    params = {a.arg for a in init.args.args + init.args.kwonlyargs}
    passed = {"model", "reward_funcs", "train_dataset", "callbacks", "args"}
    assert passed | ({"processing_class"} if algo == "online_dpo" else set()) <= params


@needs_trl
def test_imports_exist_in_trl_1_16():
    exported = (TRL / "__init__.py").read_text()
    for name in ("GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer"):
        assert f'"{name}"' in exported
    online = (TRL / "experimental" / "online_dpo" / "__init__.py").read_text()
    assert "OnlineDPOConfig" in online and "OnlineDPOTrainer" in online
    # TRL 1.16's OnlineDPOTrainer samples 2 completions per prompt, whatever the config says
    assert '"n": 2' in (TRL / CLASSES["online_dpo"][2]).read_text()


def test_reward_takes_trl_arguments():
    """TRL calls reward functions with keywords, conversational completions, and the dataset's columns."""
    from rewards import gsm8k_accuracy

    prompt = [{"role": "user", "content": "What is 28 + 13? Reply with only the number."}]
    completions = [[{"role": "assistant", "content": "41"}], [{"role": "assistant", "content": "28 + 13 = 42"}]]
    rewards = gsm8k_accuracy(
        prompts=[prompt] * 2, completions=completions, completion_ids=[[1], [2]], answer=["41"] * 2, trainer_state=None
    )
    assert rewards == [1.0, 0.0]
