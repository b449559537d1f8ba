"""A server that dies mid-run, through the scripts themselves on the CPU, against an HTTP stand-in for `vllm serve`.

The stand-in answers /health and /v1/completions over real HTTP (sampling with the script's own Hugging Face sampler
from the weights it last got) and takes each weight push as POST /update_weights (the test's push copies the trainer's
weights; the real IPC or NCCL transfer needs a GPU). It can be killed inside a round or inside a push (its port then
refuses connections), made to answer 500 everywhere as a dead engine does, and started again on its port holding its
start-up weights. What is checked: the trainer waits for it, saying so in one line; pushes it the current weights before
it generates again; redoes the round that was lost, so that the prompts trained are an uninterrupted run's, one
metrics line per step; goes on with the servers that still answer; and when none comes back writes the checkpoint of
the last completed step, prints one line with the resume command and exits with 75.
"""

import contextlib
import json
import runpy
import shlex
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

import rewards
import vllm_utils
from grpo_cli import ROOT, SMALL, STORIES, read_metrics, write_jsonl

PROMPTS = [
    f"Once upon a time, there was a little {animal} named {name}."
    for animal, name in [
        ("girl", "Lily"),
        ("boy", "Tim"),
        ("cat", "Tom"),
        ("dog", "Max"),
        ("bird", "Sue"),
        ("fox", "Ben"),
    ]
]


class StandIn:
    """One `vllm serve` on a fixed port; `plan` maps (path, call number) to what goes wrong there: "kill" (the server
    dies and the request gets no answer) or "500" (a dead engine: every path answers 500 until the restart). A
    killed server comes back after `restart_after` seconds (None: never), holding its start-up weights (version 0)."""

    def __init__(self, args_box, plan=None, restart_after=2.0):
        self.args_box, self.plan, self.restart_after = args_box, dict(plan or {}), restart_after
        self.calls, self.served, self.lock, self.dead = {}, [], threading.Lock(), False
        self.httpd, self.port = None, None
        # loaded once: a restart's from_pretrained in a timer thread would race the trainer's own load (transformers
        # builds models on the meta device through process-wide patches)
        self.model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
        self.startup = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.up()

    def up(self):
        self.model.load_state_dict(self.startup)
        self.version, self.dead = 0, False  # start-up weights
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.answer(*stand_in.answer(self.path, None))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                result = stand_in.answer(self.path, body)
                if result is None:  # killed: no answer
                    self.close_connection = True
                    return
                self.answer(*result)

            def answer(self, status, payload):
                data = json.dumps(payload).encode()
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port or 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def kill(self, how):
        self.dead = how
        if how == "kill":  # the port closes
            httpd, self.httpd = self.httpd, None
            threading.Thread(target=lambda: (httpd.shutdown(), httpd.server_close()), daemon=True).start()
        if self.restart_after is not None:
            threading.Timer(self.restart_after, self.restart).start()

    def restart(self):
        with self.lock:  # no request samples while the weights go back to the start-up ones
            if self.dead == "kill":
                self.up()
            else:
                self.model.load_state_dict(self.startup)
                self.version, self.dead = 0, False

    def answer(self, path, body):
        with self.lock:
            count = self.calls[path] = self.calls.get(path, 0) + 1
            fault = self.plan.pop((path, count), None)
            if fault:
                self.kill(fault)
                if fault == "kill":
                    return None
            if self.dead:
                return 500, {"error": "EngineDeadError"}
            if path == "/health":
                return 200, {}
            if path == "/update_weights":
                self.model.load_state_dict(self.args_box["trainer"].state_dict())
                self.version += 1
                return 200, {}
            version = self.version
        prompts, n = body["prompt"], body["n"]
        args = self.args_box["args"]
        import grpo

        during_push = self.args_box.get("pushing", 0) > 0  # a push of the trainer's is on its way
        with self.lock:
            torch.manual_seed(sum(map(sum, prompts)))
            eos = [self.model.generation_config.eos_token_id]
            completions, _ = grpo.hf_generate(self.model, prompts, args, eos, 0, n, body["temperature"])
            self.served.append((version, prompts, during_push))
        choices = [
            {"index": k, "token_ids": c, "logprobs": {"token_logprobs": [-1.0] * len(c)}}
            for k, c in enumerate(completions)
        ]
        return 200, {"choices": choices}


@pytest.fixture
def fake_vllm(monkeypatch):
    """Routes the scripts' vLLM calls to stand-ins: start returns an engine of their URLs (IPC, as on one GPU), the
    push is POST /update_weights to each, and a restarted server's checks pass."""
    box = {}

    def install(servers, timeout=60.0):
        def start(args, model_path, max_prompt_length, max_images=0):
            box["args"] = args
            urls = [s.url for s in servers]
            facts = {"model_id": "m", "backend": "ipc", "version": "0.26.0", "cache_config": {"num_gpu_blocks": 64}}
            engine = {"mode": "server", "fields": vllm_utils.sampling_fields(args), "n": args.num_generations}
            engine |= {"model": model_path, "base_urls": urls, "base_url": urls[0], "servers": [facts], "server": facts}
            return engine | vllm_utils.SERVER_OPTIONS | {"vllm_server_timeout": timeout, "model_checked": True}

        # slow (push_seconds): a round sampled meanwhile would be seen
        def push(engine, model, urls, changed_only=False):
            box["trainer"], box["pushing"] = model, box.get("pushing", 0) + 1
            try:
                time.sleep(box.get("push_seconds", 0.0))
                for url in urls:
                    vllm_utils._post(url, "/update_weights", 30)
            finally:
                box["pushing"] -= 1

        monkeypatch.setattr(vllm_utils, "start", start)
        monkeypatch.setattr(vllm_utils, "server_push", push)
        monkeypatch.setattr(vllm_utils, "check_server", lambda url, model: {})
        monkeypatch.setattr(vllm_utils, "check_same_model", lambda *a, **k: None)
        monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])

    box["install"] = install
    return box


@pytest.fixture
def trained(monkeypatch):
    """The prompts each scored round held, in order: a reward function that records them (scored = trained here)."""
    seen = []

    def recording_reward(completions, prompts, **kwargs):
        seen.append(sorted(set(prompts)))
        return [float(len(c)) for c in completions]

    recording_reward.__module__ = "rewards"  # a reward of rewards.py, as --reward-funcs takes them
    monkeypatch.setattr(rewards, "recording_reward", recording_reward, raising=False)
    return seen


def run(script, monkeypatch, data, out, *extra):
    args = [*SMALL, "--reward-funcs", "recording_reward", "--use-vllm", "--vllm-mode", "server", "--seed", 3]
    args += ["--dataset-name", data, "--output-dir", out, "--max-steps", 6, *extra]
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runpy.run_path(str(ROOT / script), run_name="__main__")


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "stories.jsonl", [{"prompt": p} for p in PROMPTS])


def uninterrupted(script, monkeypatch, data, tmp_path, fake_vllm, trained, flag):
    server = StandIn(fake_vllm)
    fake_vllm["install"]([server])
    run(script, monkeypatch, data, tmp_path / "whole", flag)
    order, _ = list(trained), trained.clear()
    return order


@pytest.mark.parametrize("flag", ["--no-async-generation", "--async-generation"])
@pytest.mark.parametrize(
    "fault", [("/v1/completions", 3, "kill"), ("/update_weights", 3, "kill"), ("/v1/completions", 4, "500")]
)
def test_server_lost_and_restarted_costs_no_step(tmp_path, monkeypatch, capsys, data, fake_vllm, trained, flag, fault):
    expected = uninterrupted("grpo.py", monkeypatch, data, tmp_path, fake_vllm, trained, flag)
    path, call, how = fault
    server = StandIn(fake_vllm, plan={(path, call): how}, restart_after=3.0)
    fake_vllm["install"]([server])
    fake_vllm["push_seconds"] = 0.5  # long enough that a round generated beside a push would be seen
    run("grpo.py", monkeypatch, data, tmp_path / "run", flag)
    assert not server.plan  # the fault happened
    assert trained == expected  # the lost round was redone: the same prompts, none twice, none skipped
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    # the restarted server (version 0: its start-up weights) got the trainer's before it generated again
    assert all(version > 0 for version, _, _ in server.served), [v for v, _, _ in server.served]
    assert not any(during for _, _, during in server.served)  # one push at a time, and no round beside it
    said = [line for line in capsys.readouterr().out.splitlines() if "stopped answering" in line]
    assert len(said) == 1 and server.url in said[0] and "--vllm-server-timeout" in said[0], said
    assert "Restart it with: " in said[0] and "--kv-cache-memory-bytes" in said[0] and "--host 127.0.0.1" in said[0]


@pytest.mark.parametrize("script", ["rloo.py", "online_dpo.py"])
def test_server_lost_in_a_background_round_of_rloo_and_online_dpo(
    tmp_path, monkeypatch, data, fake_vllm, trained, script
):
    expected = uninterrupted(script, monkeypatch, data, tmp_path, fake_vllm, trained, "--async-generation")
    server = StandIn(fake_vllm, plan={("/v1/completions", 3): "kill"}, restart_after=3.0)
    fake_vllm["install"]([server])
    run(script, monkeypatch, data, tmp_path / "run", "--async-generation")
    assert not server.plan and trained == expected
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    assert all(version > 0 for version, _, _ in server.served)


@pytest.mark.parametrize("flag", ["--no-async-generation", "--async-generation"])
def test_server_lost_of_two_goes_on_with_the_other(tmp_path, monkeypatch, data, fake_vllm, trained, flag):
    expected = uninterrupted("grpo.py", monkeypatch, data, tmp_path, fake_vllm, trained, flag)
    survivor, lost = StandIn(fake_vllm), StandIn(fake_vllm, plan={("/update_weights", 2): "kill"}, restart_after=1.0)
    fake_vllm["install"]([lost, survivor])
    run("grpo.py", monkeypatch, data, tmp_path / "run", flag, "--vllm-generation-chunk-size", 1)
    assert not lost.plan and trained == expected
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
    # the restarted one was taken back once it had the current weights, and never served its start-up ones
    assert lost.version > 0 and all(v > 0 for v, _, _ in lost.served + survivor.served)
    assert survivor.calls["/update_weights"] == 7  # the start-up push and one a step: none missed, none doubled


@pytest.mark.parametrize("flag", ["--no-async-generation", "--async-generation"])
def test_server_lost_for_good_writes_the_last_step_and_exits_75(
    tmp_path, monkeypatch, capsys, data, fake_vllm, trained, flag
):
    expected = uninterrupted("grpo.py", monkeypatch, data, tmp_path, fake_vllm, trained, flag)
    server = StandIn(fake_vllm, plan={("/v1/completions", 4): "kill"}, restart_after=None)
    fake_vllm["install"]([server], timeout=3.0)
    with pytest.raises(SystemExit) as stopped:
        run("grpo.py", monkeypatch, data, tmp_path / "run", flag)
    assert stopped.value.code == 75
    steps = [m["step"] for m in read_metrics(tmp_path / "run")]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last >= 2
    assert (tmp_path / "run" / f"checkpoint-{last}" / "trainer_state.pt").exists()
    said = capsys.readouterr()
    errors = [line for line in said.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"wrote checkpoint-{last}" in errors[0], said.err[-2000:]
    resume = errors[0].split("resume with: ", 1)[1]
    assert resume.endswith(f"--output-dir {tmp_path / 'run'} --resume-from-checkpoint latest"), resume
    # the command it names continues the run: the prompts trained are the uninterrupted run's, each step logged once
    server = StandIn(fake_vllm)
    fake_vllm["install"]([server])
    trained.clear()
    argv = shlex.split(resume)[1:]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    assert trained == expected[len(expected) - len(trained) :] and len(trained) == 6 - last
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("dies_at", [3, 1])
def test_server_lost_colocated_engine_dead_writes_the_last_step_and_exits_75(
    tmp_path, monkeypatch, capsys, data, trained, dies_at
):
    """A colocated engine that dies: vLLM's EngineDeadError, or in process (external_launcher) a CUDA error. At step 3
    the checkpoint of step 2 is written; at step 1 there is none, and the line says to start again."""

    class EngineDeadError(Exception):  # vLLM's class name: the trainer tells it by name, without importing vLLM
        pass

    calls = []

    def generate(engine, prompt_ids, n=None, temperature=None, images=None):
        calls.append(1)
        if len(calls) == dies_at:
            raise EngineDeadError("EngineCore died") if dies_at == 3 else RuntimeError("CUDA error: an illegal memory")
        import grpo

        eos = [model.generation_config.eos_token_id]
        completions, _ = grpo.hf_generate(model, prompt_ids, engine["args"], eos, 0, n, temperature)
        return completions, [[-1.0] * len(c) for c in completions]

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    monkeypatch.setattr(vllm_utils, "setup_problems", lambda: [])
    monkeypatch.setattr(vllm_utils, "start_with_weights", lambda args, *a: {"mode": "colocate", "args": args})
    monkeypatch.setattr(vllm_utils, "generate", generate)
    monkeypatch.setattr(vllm_utils, "sync_weights", lambda engine, model: None)
    monkeypatch.setattr(vllm_utils, "sleep", lambda engine: None)
    args = [*SMALL, "--reward-funcs", "recording_reward", "--use-vllm", "--vllm-mode", "colocate"]
    args += ["--dataset-name", data, "--output-dir", tmp_path / "run"]
    monkeypatch.setattr(sys, "argv", ["grpo.py", *map(str, [*args, "--max-steps", 6])])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "grpo.py"), run_name="__main__")
    assert stopped.value.code == 75
    said = capsys.readouterr()
    errors = [line for line in said.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, said
    if dies_at == 3:
        assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
        assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.pt").exists()
        assert "EngineDeadError" in errors[0] and "--resume-from-checkpoint latest" in errors[0]
    else:  # nothing trained: no checkpoint, and no resume command that would find none
        assert "CUDA error" in errors[0] and errors[0].endswith("no checkpoint to resume: start the run again")
