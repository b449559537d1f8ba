"""--async-generation, run through the scripts themselves on the CPU with a stand-in for the vLLM server.

The stand-in replaces vllm_utils' start / generate / sync_weights / sleep. Like a real server it samples from the last
weights it was sent (with the script's own Hugging Face sampler) and returns its log-probs of the sampled tokens; it
records which weight version served each request and whether a weight update ever arrived while a request was being
served. So a test can tell whether each round was generated one step behind, whether vLLM's log-probs sit on the rows
they belong to (the trainer's log-probs match them exactly when no update came in between), and whether the run
stopped with nothing in flight.
"""

import runpy
import sys
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_utils
from grpo_cli import ROOT, SMALL, read_metrics, run_script, write_jsonl

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tim went to the park.",
    "The cat sat on the mat and",
    "Sue had a red ball. She",
    "Tom and his mom went to the store to buy",
]


class StandInServer:
    def __init__(self, monkeypatch, delay=0.2):
        self.delay, self.version, self.in_flight, self.updates_while_serving = delay, 0, 0, 0
        self.requests, self.lock, self.sampling = [], threading.Lock(), threading.Lock()
        for name in ("start", "generate", "sync_weights", "sleep"):
            monkeypatch.setattr(vllm_utils, name, getattr(self, name))
        monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])  # no GPU or vLLM needed to stand in

    def start(self, args, model_path, max_prompt_length, max_images=0):
        self.args, self.model = args, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        return {"mode": "server"}

    def generate(self, engine, prompt_ids, n=None, temperature=None, images=None):
        import grpo

        with self.lock:  # requests in the order they arrive
            self.in_flight += 1
            request = {"version": self.version, "prompts": prompt_ids, "n": n, "temperature": temperature}
            seed = 1000 * len(self.requests)  # reproducible per request, in arrival order
            self.requests.append(request)
        time.sleep(self.delay)  # long enough that training runs meanwhile
        eos = self.model.generation_config.eos_token_id
        with self.sampling:  # rounds in flight at once would interleave their draws from torch's one global generator
            torch.manual_seed(seed)
            completions, _ = grpo.hf_generate(self.model, prompt_ids, self.args, [eos], 0, n, temperature)
        logprobs = []
        with torch.no_grad():
            for k, completion in enumerate(completions):
                prompt = prompt_ids[k // (n or self.args.num_generations)]
                logits = self.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
                token_logprobs = (logits / (temperature or self.args.temperature)).log_softmax(-1)  # greedy: unused
                logprobs.append(token_logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist())
        with self.lock:
            self.in_flight -= 1
            request["end_version"] = self.version
            request["completions"] = completions
        return completions, logprobs

    def sync_weights(self, engine, model):
        with self.lock:
            self.updates_while_serving += self.in_flight > 0
            self.model.load_state_dict(model.state_dict())
            self.version += 1

    def sleep(self, engine):
        pass


def run_in_process(script, monkeypatch, *args):
    """Run a training script in this process (so that the stand-in is what it talks to), as `python script args`."""
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runpy.run_path(str(ROOT / script), run_name="__main__")


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p, "keyword": "the"} for p in PROMPTS])


ARGS = [*SMALL, "--use-vllm", "--vllm-mode", "server", "--seed", 3, "--max-completion-length", 12]


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
@pytest.mark.parametrize("async_generation", [False, True])
def test_async_generation_trains_on_rounds_one_step_behind(tmp_path, monkeypatch, data, script, async_generation):
    # async: the 0.2 s delay keeps the next round in flight while the step trains, so that a push during it would be
    # seen (with 0.05 s, a script that pushed without waiting went unnoticed in 1 of 3 online DPO runs); without
    # --async-generation nothing trains during a round, and the version checks below are what can fail
    server = StandInServer(monkeypatch, delay=0.2 if async_generation else 0.05)
    flag = "--async-generation" if async_generation else "--no-async-generation"
    run_in_process(
        script, monkeypatch, *ARGS, "--dataset-name", data, "--output-dir", tmp_path / "run", "--max-steps", 4, flag
    )
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # one round per step, none started for a step that never comes, none still running, no update while serving
    assert len(server.requests) == 4 and server.in_flight == 0 and server.updates_while_serving == 0
    assert all(r["version"] == r["end_version"] for r in server.requests)  # each round from one weight version
    # the first push (version 1) holds the initial weights, and each step's update is pushed after it (online DPO's
    # only if the step had a pair: it updates nothing otherwise)
    pushed = [m.get("num_pairs", 1) > 0 for m in metrics]
    versions = [r["version"] for r in server.requests]
    staleness = [m["sampling/staleness"] for m in metrics]
    if async_generation:  # round s+1 starts at step s, before step s's update: one step behind from step 2 on
        assert versions == [1] + [1 + sum(pushed[: s - 1]) for s in range(1, 4)]
        assert staleness == [0, 1, 1, 1] or script == "online_dpo.py"
    else:
        assert versions == [1 + sum(pushed[:s]) for s in range(4)]
        assert staleness == [0, 0, 0, 0] or script == "online_dpo.py"
    if script != "online_dpo.py":  # the importance-sampling correction sees vLLM's log-probs, on the right rows
        mismatch = [m["sampling/sampling_logp_difference/mean"] for m in metrics]
        if async_generation:  # those of the weights before the last step: differing once an update moved them (a
            # step whose rewards all tie has zero gradient, and AdamW moves nothing before its first nonzero one), and only
            # slightly (log-probs attached to another row's tokens would differ by nats)
            moved = [any(m["grad_norm"] > 0 for m in metrics[:i]) for i in range(len(metrics))]
            assert mismatch[0] < 1e-5 and all(d < 0.5 for d in mismatch), mismatch
            assert all(d > 1e-5 for d, m in zip(mismatch, moved) if m) and any(moved[1:]), (mismatch, moved)
        else:
            assert all(d < 1e-5 for d in mismatch), mismatch  # same weights, same rows: the log-probs agree exactly
    for m in metrics:  # where a step goes (online DPO skips the update, and the push, on a step without pairs)
        phases = ["generation", "generation_wait", "scoring"]
        phases += ["forward_backward", "optimizer", "weight_sync"] if m.get("num_pairs", 1) else []
        phases += [] if script == "online_dpo.py" else ["old_ref_logprobs"]
        assert all(m[f"timing/{phase}"] >= 0 for phase in phases), (phases, m)
    assert metrics[-1]["timing/generation"] >= server.delay


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
@pytest.mark.parametrize("async_generation", [False, True])
def test_an_async_push_runs_beside_the_next_step_while_the_weights_hold_still(
    tmp_path, monkeypatch, data, script, async_generation
):
    """--async-generation: each push after the first runs in the background, beside the next step's scoring, and the
    optimizer step waits for it (the weights it reads never change under it); the round after it waits for it too
    (the stand-in counts an update while serving). Without the flag every push is in the loop, beside nothing."""
    import rewards

    server = StandInServer(monkeypatch, delay=0.05)
    pushes, scored, stand_in_push, stand_in_score = [], [], server.sync_weights, rewards.score

    def slow_push(engine, model):  # slow enough that the next step's scoring comes inside it when it can
        before = {k: v.clone() for k, v in model.state_dict().items()}
        t0 = time.monotonic()
        time.sleep(0.4)
        stand_in_push(engine, model)
        held = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        pushes.append((t0, time.monotonic(), held, threading.current_thread() is threading.main_thread()))

    monkeypatch.setattr(vllm_utils, "sync_weights", slow_push)

    def score(*args, **kwargs):  # the sleep lets a push thread just started reach its clock first (the GIL)
        time.sleep(0.02)
        scored.append(time.monotonic())
        return stand_in_score(*args, **kwargs)

    monkeypatch.setattr(rewards, "score", score)
    flag = "--async-generation" if async_generation else "--no-async-generation"
    common = [*ARGS, "--dataset-name", data, "--output-dir", tmp_path / "run", "--max-steps", 4, flag]
    run_in_process(script, monkeypatch, *common, "--eval-steps", 2, "--eval-dataset", data)  # evaluation waits too
    metrics = [m for m in read_metrics(tmp_path / "run") if m["step"] > 0]  # (step 0: the evaluation before training)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and server.updates_while_serving == 0
    assert all(held for _, _, held, _ in pushes) and len(pushes) >= 3, pushes  # the initial push and the steps'
    beside = [any(t0 < t < t1 for t in scored) for t0, t1, _, _ in pushes]
    on_main = [main for *_, main in pushes]
    if async_generation:  # the initial push is at start-up, the last one beside the end of the run only
        assert on_main[0] and not any(on_main[1:]) and any(beside), (on_main, beside)
        waited = [m["timing/weight_sync"] for m in metrics[1:] if "timing/weight_sync_wait" in m]
        assert waited and all(s >= 0.4 for s in waited), metrics  # the push's own time, reported by the step after
        if script != "online_dpo.py":  # (its steps without a pair push nothing) every push is logged once, also
            # one that evaluation waited for (step 2's, logged by step 3), and the wait is not the optimizer's time
            steps = [m for m in metrics if "timing/forward_backward" in m]
            assert all("timing/weight_sync_wait" in m for m in steps[1:]), steps
            assert all(m["timing/optimizer"] < 0.3 for m in steps), steps
    else:
        assert all(on_main) and not any(beside), (on_main, beside)
    training_rounds = [r for r in server.requests if r["n"] is None]  # (evaluation asks for n completions)
    assert server.in_flight == 0 and len(training_rounds) == 4


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_async_resume_generates_the_round_in_flight_again(tmp_path, monkeypatch, data, script):
    server = StandInServer(monkeypatch, delay=0.0)
    common = [*ARGS, "--dataset-name", data, "--async-generation", "--max-steps", 4, "--output-dir", tmp_path / "run"]
    run_in_process(script, monkeypatch, *common, "--save-steps", 2)
    full = [r["prompts"] for r in server.requests]
    # at the checkpoint of step 2, round 3 was generating in the background: it is not counted as consumed...
    state = torch.load(tmp_path / "run" / "checkpoint-2" / "trainer_state.pt", weights_only=False)
    assert state["prompts_consumed"] == 2 * 2  # two rounds of 2 prompts trained
    # ...so a resume generates it again, then round 4, and nothing more
    server.requests.clear()
    run_in_process(script, monkeypatch, *common, "--resume-from-checkpoint", tmp_path / "run" / "checkpoint-2")
    assert [r["prompts"] for r in server.requests] == full[2:]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_async_generation_needs_a_server(tmp_path, data, script):
    result = run_script(script, *SMALL, "--dataset-name", data, "--output-dir", tmp_path / "x", "--async-generation")
    assert result.returncode != 0 and "--async-generation needs --use-vllm --vllm-mode server" in result.stderr


@pytest.mark.parametrize(
    "extra, steps, staleness",
    [
        (["--steps-per-generation", 2], [2, 4], [0, 2]),  # one round per 2 optimizer steps: 2 steps behind
        (["--num-iterations", 2], [2, 4], [0, 2]),
        (["--dynamic-sampling", "--dynamic-sampling-max-rounds", 3], [1, 2, 3, 4], None),
    ],
)
def test_async_generation_with_rounds_of_several_steps_and_dynamic_sampling(
    tmp_path, monkeypatch, data, extra, steps, staleness
):
    server = StandInServer(monkeypatch, delay=0.05)
    run_in_process(
        "grpo.py",
        monkeypatch,
        *ARGS,
        "--dataset-name",
        data,
        "--output-dir",
        tmp_path / "run",
        "--max-steps",
        4,
        "--async-generation",
        *extra,
    )
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == steps
    assert server.in_flight == 0 and server.updates_while_serving == 0
    assert all(r["version"] == r["end_version"] for r in server.requests)
    if staleness is not None:
        assert [m["sampling/staleness"] for m in metrics] == staleness
        assert len(server.requests) == 2  # no round for optimizer steps that never come
    else:  # refill rounds are generated by the current weights, the prefetched one by the previous: 0 <= mean <= 1
        rounds = [m["dynamic_sampling/generation_rounds"] for m in metrics]
        assert len(server.requests) == sum(rounds) and all(0 <= m["sampling/staleness"] <= 1 for m in metrics)


@pytest.mark.parametrize("script", ["grpo.py", "online_dpo.py"])
def test_generate_without_vllm_is_never_stale(tmp_path, data, script):
    # Hugging Face generate samples from the model being trained: staleness 0 at every step
    from grpo_cli import check

    check(run_script(script, *SMALL, "--dataset-name", data, "--output-dir", tmp_path / "run", "--max-steps", 3))
    assert [m["sampling/staleness"] for m in read_metrics(tmp_path / "run")] == [0, 0, 0]


@pytest.mark.parametrize("script", ["grpo.py", "rloo.py", "online_dpo.py"])
def test_the_phase_clock_waits_for_the_trainers_stream_not_the_pushs(monkeypatch, script):
    """clock() charges a phase the work queued on the calling thread's stream. A device-wide synchronize also waited
    for --async-generation's background push (its own stream), so a NCCL push blocked the next step's phases."""
    clock = runpy.run_path(str(ROOT / script), run_name="not_main")["clock"]
    waited = []

    class Stream:
        def synchronize(self):
            waited.append("this thread's stream")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waited.append("the whole device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: waited.append(device) or Stream())
    clock(torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0), "this thread's stream"]
    waited.clear()
    clock(torch.device("cpu"))
    assert waited == []
