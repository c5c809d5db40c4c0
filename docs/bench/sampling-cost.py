"""What sampling costs a decode step, against greedy decoding of the same model in the same run (docs/bench/log.md,
"Sampling a batch in one call"): 32 rows of a `small` model widened to a 32k vocabulary (Mixtral's), 32 new tokens
each, greedy and three samplings, in alternating rounds; decode tokens/s each and its ratio to greedy.

    PYTHONPATH=. python docs/bench/sampling-cost.py [ROUNDS]
"""

import dataclasses
import statistics
import sys
import time

import torch

from moeserve.config import preset
from moeserve.runtime.engine import Engine, SamplingParams
from moeserve.runtime.model import Transformer
from moeserve.tokenizer import ByteTokenizer

ROWS, PROMPT, NEW = 32, 16, 32
KINDS = {"greedy": SamplingParams(),
         "temperature 0.8": SamplingParams(temperature=0.8),
         "top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
         "top_k 50, top_p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95)}


def main(rounds: int = 3) -> None:
    torch.manual_seed(0)
    engine = Engine.from_model(Transformer(preset("small", vocab_size=32000)), ByteTokenizer(), dtype="float32")
    prompts = torch.randint(0, 32000, (ROWS, PROMPT)).tolist()

    def decode_s(p: SamplingParams, n: int) -> float:
        params = [dataclasses.replace(p, max_new_tokens=n, ignore_eos=True, seed=i) for i in range(ROWS)]
        t = time.perf_counter()
        engine.complete(prompts, params)
        return time.perf_counter() - t

    times = {k: [] for k in KINDS}
    for p in KINDS.values():
        decode_s(p, 2)  # warm-up
    for _ in range(rounds):
        for k, p in KINDS.items():  # NEW tokens less the first (prefill): the decode steps' time
            times[k].append((decode_s(p, NEW) - decode_s(p, 1)) / (NEW - 1))
    greedy = statistics.median(times["greedy"])
    print(f"{ROWS} rows, vocabulary 32000, torch threads {torch.get_num_threads()}")
    for k, ts in times.items():
        s = statistics.median(ts)
        print(f"{k:22s} {1e3 * s:7.1f} ms a step  {ROWS / s:7.0f} tokens/s  {greedy / s:5.2f}x greedy's rate")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
