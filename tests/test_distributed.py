"""Several processes on the CPU (torchrun, gloo, FSDP2): the scripts end with the same weights on 2 ranks as on 1 with
the same global batch (and tests/dist_step.py's copy of each loss's step, with signal on every rank), and they train,
checkpoint and resume under `torchrun --nproc_per_node 2`. The workers are forked from tests/prefork.py with torchrun's
environment; test_the_scripts_take_the_same_steps_on_two_ranks_as_on_one[grpo.py] runs torchrun itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_cli import ASSETS, SMALL, launch, read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="")


def torchrun(nproc, script, *args, timeout=300, preimport=()):
    """`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS` on the CPU; the workers are forked from tests/prefork.py
    with torchrun's environment (test_grpo_step_under_real_torchrun_equals_one_process runs torchrun itself)."""
    return launch(script, *args, nproc=nproc, timeout=timeout, preimport=preimport)


def test_two_ranks_take_the_same_step_as_one(tmp_path):
    for n in (1, 2):
        result = torchrun(n, "tests/dist_step.py", tmp_path / f"step{n}.pt")
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = torch.load(tmp_path / "step1.pt"), torch.load(tmp_path / "step2.pt")
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "rloo", "online_dpo"):
        for kind in ("grads", "weights"):
            a, b = one[loss_type][kind], two[loss_type][kind]
            assert a.keys() == b.keys()
            for name in a:
                assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-5), (loss_type, kind, name)
        # the step did something: the weights moved
        assert any(g.abs().max() > 1e-3 for g in one[loss_type]["grads"].values())


SAME_STEPS_SCRIPTS = [("grpo.py", True), ("rloo.py", False), ("online_dpo.py", False)]  # (script, real torchrun)


def run_on_one_and_two_ranks(background, tmp_path, script, real_torchrun, extra=()):
    """The runs of test_the_scripts_take_the_same_steps_on_two_ranks_as_on_one: `python SCRIPT` (output tmp_path/one)
    and `torchrun --nproc_per_node 2 SCRIPT` (tmp_path/two), torchrun itself if real_torchrun, on the same global
    batch, with the `extra` arguments; a background job (conftest.py's same_steps_runs, lora_same_steps_run). Returns
    tmp_path and the two CompletedProcesses."""
    from itertools import islice

    from grpo_cli import STORIES, write_jsonl

    module = __import__(script[:-3])
    seed = next(s for s in range(100) if list(islice(module.prompt_stream(2, s), 2)) == [0, 1])  # "She" row first
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "The cat was sad.", "keyword": "She"}, {"prompt": "The cat was sad.", "keyword": "zzzqqq"}],
    )
    args = [
        "--model-name-or-path",
        STORIES,
        "--dataset-name",
        data,
        "--prompt-column",
        "prompt",
        "--answer-column",
        "",
        "--no-use-chat-template",
        "--no-bf16",
        "--reward-funcs",
        "keyword_reward",
        "--prompts-per-step",
        2,
        "--num-generations",
        8,
        "--max-completion-length",
        1,
        "--learning-rate",
        1e-2,
        "--seed",
        seed,
    ]
    args += {
        "grpo.py": ["--num-iterations", 2, "--max-steps", 2],
        "online_dpo.py": ["--max-steps", 1],
        "rloo.py": ["--num-iterations", 2, "--max-steps", 2, "--beta", 0],
    }[script] + list(extra)  # RLOO's KL-in-reward would reward rank 1's rows
    one = background.process(script, *args, "--output-dir", tmp_path / "one", timeout=1800).result()
    if real_torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
        run = background.popen(
            [*command, *args, "--output-dir", tmp_path / "two"],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stdout, stderr = run.communicate(timeout=1800)
        two = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
    else:
        two = background.process(script, *args, "--output-dir", tmp_path / "two", nproc=2, timeout=1800).result()
    return tmp_path, one, two


@pytest.mark.parametrize("script, real_torchrun", SAME_STEPS_SCRIPTS)
def test_the_scripts_take_the_same_steps_on_two_ranks_as_on_one(same_steps_runs, script, real_torchrun):
    """The scripts themselves, not a copy of their loop: `python SCRIPT` and `torchrun --nproc_per_node 2 SCRIPT` on
    the same global batch end with the same weights. Each rank samples its own completions (seed + rank), so the data
    is one prompt twice: with keyword "She" (about a third of its first tokens) and with "zzzqqq" (never). Completions
    of 1 token (a single sampling step, whose random numbers for the first rows do not depend on the batch size) make
    the "She" group, first in the 1-process batch and rank 0's share on 2 ranks, the same in both runs; the "zzzqqq"
    group is all 0 in both, so it adds nothing to the gradient (zero advantage; no DPO pair) but still counts in the
    normalisers, and rank 1 still takes part in every FSDP collective and owns half of every updated weight. GRPO and
    RLOO take 2 optimizer steps on the round (--num-iterations 2: old log-probs, clipping). tests/dist_step.py adds
    what this cannot show: every rank's rows weighted right when all of them carry signal, for every loss type. The
    runs (run_on_one_and_two_ranks above) start in the background with the session."""
    from safetensors.torch import load_file

    from grpo_cli import STORIES

    tmp_path, one, two = same_steps_runs[script].result()
    assert one.returncode == 0, one.stderr[-4000:]
    assert two.returncode == 0, two.stderr[-4000:]
    (m1,), (m2,) = (read_metrics(tmp_path / run) for run in ("one", "two"))
    if script == "online_dpo.py":
        assert m1["num_pairs"] == m2["num_pairs"] == 1 and m1["frac_tied"] == m2["frac_tied"] == 0.5, (m1, m2)
    else:  # the "She" group has signal, the other none
        assert m1["frac_reward_zero_std"] == m2["frac_reward_zero_std"] == 0.5, (m1, m2)
    for key in ("loss", "grad_norm", "objective/scores" if script == "online_dpo.py" else "reward"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), (key, m1[key], m2[key])
    start, w1, w2 = (
        load_file(path / "model.safetensors") for path in (Path(STORIES), tmp_path / "one", tmp_path / "two")
    )
    assert max((w1[name] - start[name]).abs().max() for name in w1) > 5e-3  # the steps moved the weights
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=1e-5), (name, (w1[name] - w2[name]).abs().max())


def test_tensor_parallel_groups_generate_together_and_each_rank_gets_its_own_completions():
    # 4 ranks, --vllm-tensor-parallel-size 2: ranks (0, 1) and (2, 3) each share one engine (tests/dist_tp.py)
    result = torchrun(4, "tests/dist_tp.py", timeout=120, preimport=["vllm"])
    assert result.returncode == 0 and "TP ROUTING OK" in result.stderr, result.stderr[-3000:]


def test_weight_sync_from_fsdp2_shards_delivers_the_full_weights_in_the_announced_order():
    # server mode: rank 0 streams from a thread while rank 1 joins each gather; colocate: every rank loads (tests/dist_weights.py)
    result = torchrun(2, "tests/dist_weights.py", timeout=180)
    assert result.returncode == 0 and "WEIGHT SYNC OK" in result.stderr, result.stderr[-3000:]


def test_grpo_under_torchrun_trains_saves_and_resumes(tmp_path):
    data = ASSETS / "stories_prompts.jsonl"
    out = tmp_path / "run"
    common = [
        *SMALL,
        "--dataset-name",
        data,
        "--output-dir",
        out,
        "--prompts-per-step",
        4,
        "--beta",
        0.04,
        "--num-iterations",
        2,
        "--save-steps",
        2,
    ]
    result = torchrun(2, "grpo.py", *common, "--max-steps", 4)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [2, 4]  # one line per round (2 optimizer steps each), from rank 0 only
    assert all(m["kl/k3_token_mean"] >= 0 for m in metrics)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(ASSETS / "stories260K")
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)
    assert (out / "checkpoint-2" / "trainer_state.pt").exists()

    resumed = torchrun(2, "grpo.py", *common, "--max-steps", 6, "--resume-from-checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [2, 4, 6]


def test_rloo_under_torchrun_trains_and_saves(tmp_path):
    out = tmp_path / "run"
    result = torchrun(
        2,
        "rloo.py",
        *SMALL,
        "--dataset-name",
        ASSETS / "stories_prompts.jsonl",
        "--output-dir",
        out,
        "--prompts-per-step",
        4,
        "--max-steps",
        3,
        "--normalize-advantages",
        "--save-steps",
        2,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("kl/k1_token_mean" in m for m in metrics)  # beta 0.05: a reference model
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    assert (out / "checkpoint-2" / "trainer_state.pt").exists()


def test_grpo_dynamic_sampling_under_torchrun(tmp_path):
    # half the prompts can never be rewarded ("zzzqqq"): ranks refill their share in lockstep (same number of rounds)
    from grpo_cli import write_jsonl

    prompts = [
        "Once upon a time, there was a little girl named Lily.",
        "One day, a boy named Tim went to the park.",
        "The cat was sad.",
        "Sam and Mia wanted to play a game.",
    ]
    data = write_jsonl(
        tmp_path / "mixed.jsonl", [{"prompt": p, "keyword": k} for p in prompts for k in ("the", "zzzqqq")]
    )
    out = tmp_path / "run"
    result = torchrun(
        2,
        "grpo.py",
        *SMALL,
        "--dataset-name",
        data,
        "--output-dir",
        out,
        "--prompts-per-step",
        4,
        "--max-completion-length",
        16,
        "--max-steps",
        2,
        "--dynamic-sampling",
        "--dynamic-sampling-max-rounds",
        6,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # groups kept over both ranks: a full step unless it gave up after 6 rounds
        assert m["dynamic_sampling/kept_groups"] in (2, 4) and (
            m["dynamic_sampling/kept_groups"] == 4 or m["dynamic_sampling/generation_rounds"] == 6
        )


def test_grpo_dynamic_sampling_pools_kept_groups_across_ranks(tmp_path):
    # 2 prompts, one per rank and round, and only prompt 0 can be rewarded. With a seed whose first 6 epochs all hand
    # prompt 1 to rank 0, rank 0 never finds a group with signal itself: the step must still train, with groups that
    # rank 1 found (the ranks pool what they kept and split it evenly) instead of giving up.
    from itertools import islice

    import grpo
    from grpo_cli import write_jsonl

    seed = next(s for s in range(1000) if list(islice(grpo.prompt_stream(2, s), 0, 12, 2)) == [1] * 6)
    data = write_jsonl(
        tmp_path / "two.jsonl",
        [
            {"prompt": "Once upon a time, there was a little girl named Lily.", "keyword": "the"},
            {"prompt": "The cat was sad.", "keyword": "zzzqqq"},
        ],
    )
    out = tmp_path / "run"
    result = torchrun(
        2,
        "grpo.py",
        *SMALL,
        "--dataset-name",
        data,
        "--output-dir",
        out,
        "--seed",
        seed,
        "--max-completion-length",
        16,
        "--num-generations",
        8,
        "--max-steps",
        1,
        "--dynamic-sampling",
        "--dynamic-sampling-max-rounds",
        6,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (metrics,) = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert metrics["dynamic_sampling/kept_groups"] == 2 and metrics["dynamic_sampling/generation_rounds"] >= 2


def test_online_dpo_under_torchrun_trains_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    common = [
        *SMALL,
        "--dataset-name",
        ASSETS / "stories_prompts.jsonl",
        "--output-dir",
        out,
        "--prompts-per-step",
        4,
        "--learning-rate",
        3e-4,
        "--save-steps",
        2,
    ]
    result = torchrun(2, "online_dpo.py", *common, "--max-steps", 3)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert "loss" not in metrics[0] or abs(metrics[0]["loss"] - 0.6931) < 1e-3  # policy = reference at step 1: log 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    resumed = torchrun(2, "online_dpo.py", *common, "--max-steps", 4, "--resume-from-checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_vision_two_ranks_take_the_same_step_as_one(tmp_path):
    """A vision-language model under FSDP2 (issue 45): grpo.py on 2 CPU ranks ends with the same weights as on 1 with
    the same global batch, the image features computed inside the sharded model's forward. As in
    test_the_scripts_take_the_same_steps_on_two_ranks_as_on_one: one image prompt twice, completions of one token, a
    keyword that the warm-started tiny VLM's first token often is (one colour word's first token) and one it never is."""
    from itertools import islice

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import grpo
    from grpo_cli import write_jsonl
    from make_tiny_vlm import make_colour_dataset, make_tiny_vlm

    vlm = tmp_path / "vlm"
    make_tiny_vlm(vlm, warm=True)
    row = json.loads(make_colour_dataset(tmp_path / "data", 1, seed=0).read_text().splitlines()[0])
    first = AutoTokenizer.from_pretrained(vlm).tokenize(row["answer"])[0].lstrip("\u2581")  # e.g. "red" -> "r"...
    data = write_jsonl(tmp_path / "data" / "d.jsonl", [{**row, "keyword": first}, {**row, "keyword": "zzzqqq"}])
    seed = next(s for s in range(100) if list(islice(grpo.prompt_stream(2, s), 2)) == [0, 1])  # the keyword row first
    args = ["--model-name-or-path", vlm, "--dataset-name", data, "--prompt-column", "prompt", "--answer-column", ""]
    args += ["--no-bf16", "--reward-funcs", "keyword_reward", "--prompts-per-step", 2, "--num-generations", 8]
    args += ["--max-completion-length", 1, "--learning-rate", 1e-2, "--seed", seed, "--max-steps", 1]
    for n in (1, 2):
        result = torchrun(n, "grpo.py", *args, "--output-dir", tmp_path / f"run{n}", timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    (m1,), (m2,) = (read_metrics(tmp_path / f"run{n}") for n in (1, 2))
    assert m1["frac_reward_zero_std"] == m2["frac_reward_zero_std"] == 0.5, (m1, m2)  # one group with signal
    for key in ("loss", "grad_norm", "reward"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), (key, m1[key], m2[key])
    start, w1, w2 = (load_file(path / "model.safetensors") for path in (vlm, tmp_path / "run1", tmp_path / "run2"))
    assert max((w1[name] - start[name]).abs().max() for name in w1) > 5e-3  # the step moved the weights
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=1e-5), (name, (w1[name] - w2[name]).abs().max())
        if "vision_model" in name:  # --freeze-vision-tower (the default): the tower as it was, on both
            assert torch.equal(w1[name], start[name]), name
