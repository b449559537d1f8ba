"""What a stock `vllm serve` spends on the CPU, outside the GPU, to return each sampled token's log-prob: measured with
vLLM's own classes on any machine (no GPU needed), for the bench-0.5b round (256 sequences x 256 decode steps).

Usage: python benchmarks/frontend_cost.py [STEPS_TIMED]
1. Every decode step the EngineCore process sends the front ends one EngineCoreOutput per running request
   (vllm/v1/serial_utils.py msgpack). With log-probs each one carries three small numpy arrays (LogprobsLists sliced per
   request), which msgpack encodes one by one in the EngineCore and decodes in the front end. The in-process engine of
   colocate mode (vllm_utils.colocate_engine, no multiprocessing) skips both.
2. After the last step, each /v1/completions request (8 prompts x n=8 x 256 tokens, vllm_utils.completions_request)
   builds its log-prob lists (OpenAIServingCompletion._create_completion_logprobs), then its JSON; the trainer parses
   it.
Prints each cost per step and per round.
"""

import json
import random
import sys
import time

import numpy as np
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.logprobs import Logprob
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

SEQUENCES, STEPS, PER_REQUEST = 256, 256, 64  # a bench round; 8 prompts x n=8 per request


def step_outputs(with_logprobs):
    """One decode step's message to the front end, as vLLM 0.26's scheduler builds it (update_from_output)."""
    ids = np.random.randint(0, 150000, (SEQUENCES, 1)).astype(np.int32)
    lists = LogprobsLists(ids, np.random.randn(SEQUENCES, 1).astype(np.float32), np.ones(SEQUENCES, dtype=np.int32))
    outputs = [
        EngineCoreOutput(
            request_id=f"cmpl-{r:04d}-0123456789abcdef-{r % 8}",
            new_token_ids=[int(ids[r, 0])],
            new_logprobs=lists.slice_request(r, 1) if with_logprobs else None,
        )
        for r in range(SEQUENCES)
    ]
    return EngineCoreOutputs(outputs=outputs)


def serialization(with_logprobs, steps):
    """(encode, decode) seconds per step of the EngineCore -> front end messages."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    messages = [step_outputs(with_logprobs) for _ in range(steps)]
    start = time.perf_counter()
    buffers = [encoder.encode(message) for message in messages]
    encoded = time.perf_counter()
    for buffer in buffers:
        decoder.decode(buffer)
    return (encoded - start) / steps, (time.perf_counter() - encoded) / steps


class _Serving:  # the attributes OpenAIServingCompletion._create_completion_logprobs reads (return_tokens_as_token_ids)
    return_tokens_as_token_ids = True
    _get_decoded_token = staticmethod(
        lambda logprob, token_id, tokenizer, return_as_token_id=False: f"token_id:{token_id}"
    )


def response_tail():
    """Seconds for one request's log-prob lists, its JSON, and the trainer's json.loads of it."""
    completions = []
    for _ in range(PER_REQUEST):
        ids = [random.randrange(150000) for _ in range(STEPS)]
        completions.append((ids, [{i: Logprob(logprob=-5 * random.random(), rank=1)} for i in ids]))
    start = time.perf_counter()
    choices = [
        CompletionResponseChoice(
            index=k,
            text="",
            token_ids=ids,
            finish_reason="length",
            logprobs=OpenAIServingCompletion._create_completion_logprobs(
                _Serving(), ids, logprobs, 0, None, return_as_token_id=True
            ),
        )
        for k, (ids, logprobs) in enumerate(completions)
    ]
    built = time.perf_counter()
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    body = JSONResponse(content=CompletionResponse(id="x", model="m", choices=choices, usage=usage).model_dump()).body
    dumped = time.perf_counter()
    json.loads(body)
    return built - start, dumped - built, time.perf_counter() - dumped, len(body)


def main(steps=64):
    for with_logprobs in (False, True):
        encode, decode = serialization(with_logprobs, steps)
        print(
            f"log-probs {'on ' if with_logprobs else 'off'}: EngineCore encode {encode * 1e3:.2f} ms a step, front-end "
            f"decode {decode * 1e3:.2f} ms a step: {(encode + decode) * STEPS:.2f} s a round of {STEPS} steps"
        )
    built, dumped, parsed, size = response_tail()
    print(
        f"one request's tail ({PER_REQUEST} x {STEPS} tokens): log-prob lists {built:.3f} s, JSON {dumped:.3f} s "
        f"({size / 1e6:.1f} MB), the trainer's json.loads {parsed:.3f} s"
    )


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
