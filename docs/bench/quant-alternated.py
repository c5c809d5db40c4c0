"""Batch-1 decode of moeserve's quantized engines against llama-bench, alternated: each engine loaded once in its own
process (its own kernel build), then one short measurement of each engine and of llama.cpp on the matching GGUF in
turn, R rounds. On a shared VM whose memory bandwidth wanders from minute to minute, the per-round ratios are the
figure that counts (docs/bench/log.md, "Quantized decode, alternated").

    PYTHONPATH=. python docs/bench/quant-alternated.py ROUNDS INT8_CKPT INT4_CKPT LLAMA_CPP_DIR Q8_0.gguf Q4_0.gguf

LLAMA_CPP_DIR holds build/bin/llama-bench (native) and build-avx2/bin/llama-bench (GGML_AVX512=OFF). The AVX2 side
runs moeserve's kernel built with -mno-avx512f and torch limited to AVX2.
"""

import json
import os
import statistics
import subprocess
import sys
import time

AVX2 = {"MOESERVE_KERNEL_CFLAGS": "-mno-avx512f", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
WORKER = r'''
import sys, time
from moeserve.runtime.engine import Engine, SamplingParams
e = Engine.load(sys.argv[1], dtype="float32", device="cpu")
prompt = e.encode("def main(args):\n    import os\n    return os.path.join(args.root, 'x')\n")[:16]
def run(n):
    t0 = time.perf_counter(); e.complete([prompt], SamplingParams(n, ignore_eos=True)); return time.perf_counter() - t0
run(4)
print("ready", e.runner.name, flush=True)
for line in sys.stdin:
    one, whole = run(1), run(65)
    print(64 / (whole - one), flush=True)
'''


def alternate(cases: list[tuple], rounds: int, worker: str, first_column: str) -> None:
    """The alternation itself, shared with family-llamacpp.py. `cases`: (name, the worker's argv, its env, llama-bench,
    GGUF, what the table says it is against); each worker (`worker`, a script that prints its tokens/s for each line
    on stdin) is loaded once, then every round measures each case's worker and llama-bench in turn. Prints each
    round, then the table of medians and per-round ratios."""
    procs = {}
    for name, argv, env, *_ in cases:
        p = subprocess.Popen([sys.executable, "-c", worker, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "2", **env})
        print(name, p.stdout.readline().strip(), flush=True)
        procs[name] = p
    ours = {name: [] for name, *_ in cases}
    theirs = {name: [] for name, *_ in cases}
    for r in range(rounds):
        for name, _, _, bench, gguf, _ in cases:
            time.sleep(0.3)
            procs[name].stdin.write("go\n")
            procs[name].stdin.flush()
            ours[name].append(float(procs[name].stdout.readline()))
            time.sleep(0.3)
            out = subprocess.run([bench, "-m", gguf, "-p", "0", "-n", "64", "-t", "2", "-r", "1", "-o", "json"],
                                 capture_output=True, text=True, check=True).stdout
            theirs[name].append(json.loads(out)[0]["avg_ts"])
        print(f"round {r + 1}: " + "  ".join(f"{n} {ours[n][-1]:.1f}/{theirs[n][-1]:.1f}" for n in ours), flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"\n| {first_column} | moeserve tokens/s (median) | llama.cpp tokens/s (median) | per-round ratio: median "
          f"(min-max) |")
    print("| --- | ---: | ---: | ---: |")
    for name, *_, vs in cases:
        ratios = [a / b for a, b in zip(ours[name], theirs[name])]
        print(f"| {name} (vs {vs}) | {statistics.median(ours[name]):.1f} | {statistics.median(theirs[name]):.1f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")


def main(rounds: int, int8: str, int4: str, llama: str, q8: str, q4: str) -> None:
    sides = {"avx512": ({"MOESERVE_KERNEL_CFLAGS": ""}, f"{llama}/build/bin/llama-bench"),
             "avx2": (AVX2, f"{llama}/build-avx2/bin/llama-bench")}
    alternate([(f"{side} {fmt}", [ckpt], env, bench, gguf, vs) for side, (env, bench) in sides.items()
               for fmt, ckpt, gguf, vs in (("int8", int8, q8, "Q8_0"), ("int4", int4, q4, "Q4_0"))],
              rounds, WORKER, "side, format")


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:7])
