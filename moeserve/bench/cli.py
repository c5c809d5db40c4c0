"""The `moeserve bench` sub-commands' arguments; each benchmark's module is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Callable

from moeserve.bench.engine import FAMILY_MODELS
from moeserve.config import PRESETS
from moeserve.convert import add_kept_weights
from moeserve.runtime import GPU_QUANT_FORMATS, QUANT_FORMATS
from moeserve.export import MODES


def _report_files(parser, plot_help: str = "draw the report into a PNG (needs matplotlib: the bench extra)") -> None:
    """--json and --plot, the same on every bench: finish() in bench/report.py writes both."""
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="write the report (with its command line and the machine) as JSON")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help=plot_help)


def _main(module: str) -> Callable[[argparse.Namespace], int]:
    return lambda args: importlib.import_module(module).main(args)


def add_bench(sub, calibrate_help: str) -> None:
    """`moeserve bench BENCH`: one sub-command per benchmark, each run by its module's main(args)."""
    b = sub.add_parser("bench", help="benchmarks, measured against a baseline in the same run")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bt = bsub.add_parser("train", help="train each routing method on the same data and compare bits per byte")
    bt.add_argument("--preset", default="small", choices=sorted(PRESETS))
    bt.add_argument("--recipes", nargs="+", default=["softmax", "xmoe", "vq", "xmoe+omoe"],
                    help="softmax sigmoid xmoe vq xmoe+omoe (default: softmax xmoe vq xmoe+omoe)")
    bt.add_argument("--steps", type=int, help="steps per recipe (default: the default model's)")
    bt.add_argument("--out", type=Path, help="keep the checkpoints here (default: a temporary directory)")
    _report_files(bt)
    bt.add_argument("--quiet", action="store_true")
    bt.set_defaults(func=_main("moeserve.bench.train"))
    bl = bsub.add_parser("layer", help="one MoE layer: moeserve's dispatch paths vs the reference loop and "
                         "transformers", description="Time one MoE layer (same weights) across implementations "
                         "and token counts, beside a dense GEMM of the same FLOPs.")
    bl.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128, 1024], help="token counts (default: 1 8 128 1024)")
    bl.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    bl.add_argument("--d-model", type=int, default=512, help="D (default: 512)")
    bl.add_argument("--d-ff", type=int, default=1408, help="F (default: 1408)")
    bl.add_argument("--experts", type=int, default=8, help="E (default: 8)")
    bl.add_argument("--top-k", type=int, default=2, help="k (default: 2)")
    bl.add_argument("--min-time", type=float, default=0.3, help="seconds of timed runs per cell (default: 0.3)")
    bl.add_argument("--sweep", action="store_true", help="instead: measure the calibration's candidates at every "
                    "token count and print them with the plan they give (nothing is cached)")
    bl.add_argument("--calibrate", action="store_true", help=calibrate_help)
    _report_files(bl)
    bl.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    bl.set_defaults(func=_main("moeserve.bench.layer"))
    be = bsub.add_parser("engine", help="greedy generation end to end: the Engine vs transformers' generate",
                         description="Greedy generation on a Hugging Face checkpoint (default: a random one of "
                         "--model's, written by transformers), moeserve's Engine against transformers' generate; at "
                         "batch 1 also the weight bytes read per second against the machine's copy bandwidth.")
    be.add_argument("--checkpoint", type=Path, help="a Hugging Face directory (default: a random one of --model's)")
    be.add_argument("--model", default="tiny", choices=("tiny", "644m", "2.4b", *FAMILY_MODELS),
                    help="the random model: a Mixtral of size tiny (76M parameters), 644m or 2.4b (2.6 and 9.8 GB in "
                    "fp32), or a preset of another family at about tiny's size: " + ", ".join(FAMILY_MODELS) +
                    " (default: tiny)")
    be.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(default: cpu)")
    be.add_argument("--batch", type=int, default=1, help="prompts decoded together (default: 1)")
    be.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    be.add_argument("--new-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    be.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default: 16)")
    be.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds after one warm-up (default: 5)")
    be.add_argument("--calibrate", action="store_true", help=calibrate_help)
    be.add_argument("--compile", action="store_true",
                    help="also time the Engine with its compiled decode step (torch.compile; see serve --compile)")
    be.add_argument("--quantize", nargs="+", choices=QUANT_FORMATS + GPU_QUANT_FORMATS, metavar="FORMAT",
                    help="also time the Engine with its weights quantized at load in each format (int8, int4; fp8 "
                    "on GPUs), compiled with --compile")
    _report_files(be)
    be.set_defaults(func=_main("moeserve.bench.engine"))
    bg = bsub.add_parser("gpu", help="the GPU acceptance run: the cuda tests, bench engine at batch 1 and 32 on the "
                         "2.4B Mixtral, decode over a 2k against a 32k context, in one JSON",
                         description="Run on one CUDA GPU, from a checkout: pytest -m cuda (parity, no host sync in "
                         "a replay, ONNX Runtime CUDA and TensorRT where installed), `bench engine` on a random 2.4B "
                         "Mixtral in bf16 at batch 1 and 32 (eager, compiled indexed and grouped_mm experts, "
                         "transformers), decode at 100 tokens of context for a 2k- and a 32k-token context, and the "
                         "built-in model served on the GPU and on 2 CPU cores (where it is cached), then a short level "
                         "under each server's profiler (its traces in NAME-profiles/ beside --json NAME.json); the "
                         "goals of issue 40 against those numbers; what was skipped and why. Exit 1 if a test "
                         "failed, 2 without a GPU.")
    bg.add_argument("--checkpoint", type=Path, help="a Hugging Face Mixtral directory (default: a random 2.4B one)")
    bg.add_argument("--skip-tests", action="store_true", help="leave out the cuda tests")
    bg.add_argument("--skip-served", action="store_true", help="leave out the built-in model served on the GPU and on "
                    "2 CPU cores")
    bg.add_argument("--skip-engine", action="store_true", help="leave out the 2.4B Mixtral (its engine bench and its "
                    "decode over two contexts): with --skip-tests, the served part alone, so that a run past one "
                    "call's time limit splits into `--skip-served` and `--skip-tests --skip-engine`")
    _report_files(bg, "batch 1's tokens/s by implementation, as a PNG (needs matplotlib: the bench extra)")
    bg.set_defaults(func=_main("moeserve.bench.gpu"))
    bsc = bsub.add_parser("score", help="batch scoring: moeserve score from a cold process and a warm engine, beside "
                          "llama.cpp's perplexity tool", description="Score records of about --tokens tokens (cut "
                          "from the built-in corpus) with `moeserve score` in a child process, timed by wall clock "
                          "from its start, and with Engine.score_ids in this process after one untimed pass; with "
                          "llama.cpp's llama-perplexity and a GGUF of the same weights, it too on the same text.")
    bsc.add_argument("--checkpoint", type=Path, help="a language model (default: the built-in default model)")
    bsc.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16"),
                     help="(default: float32)")
    bsc.add_argument("--records", type=int, default=16, metavar="N", help="records (default: 16)")
    bsc.add_argument("--tokens", type=int, default=512, metavar="T", help="tokens per record (default: 512)")
    bsc.add_argument("--repeats", type=int, default=2, metavar="R", help="timed warm passes, median; 0: no warm engine, the cold runs only (default: 2)")
    bsc.add_argument("--threads", type=int, metavar="N", help="threads of every side (default: torch's)")
    bsc.add_argument("--llama-perplexity", metavar="PATH", help="llama.cpp's perplexity tool (default: "
                     "llama-perplexity on PATH, if any)")
    bsc.add_argument("--batch-tokens", nargs="+", default=["auto"], metavar="N|auto",
                     help="moeserve score's --batch-tokens, one cold run for each (default: auto)")
    bsc.add_argument("--gguf", nargs="+", metavar="DTYPE=FILE", help="the same weights as GGUF, per dtype, e.g. "
                     "float32=mix-f32.gguf bfloat16=mix-bf16.gguf (convert_hf_to_gguf.py --outtype f32 / bf16)")
    _report_files(bsc)
    bsc.set_defaults(func=_main("moeserve.bench.score"))
    bq = bsub.add_parser("quant", help="int8 and int4 weights against the unquantized model: bits per byte, KL, top-1 "
                         "agreement, bytes and decode speed", description="Quantize a checkpoint at load in each "
                         "format and compare it with the unquantized model on held-out text of the built-in corpus "
                         "(never trained on), as llama.cpp's perplexity --kl-divergence does: bits per byte, the mean "
                         "KL divergence of the next-token distributions, top-1 agreement; and the weight bytes a "
                         "decode step reads, and batch-1 decode tokens/s.")
    bq.add_argument("--checkpoint", type=Path, help="an unquantized language model (default: the built-in one)")
    bq.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=("int8", "int4"),
                    help="(default: int8 int4)")
    bq.add_argument("--group-size", type=int, metavar="G", help="int4's group (default: 32)")
    add_kept_weights(bq)
    bq.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="activations and unquantized weights (default: float32)")
    bq.add_argument("--records", type=int, default=16, metavar="N", help="held-out records (default: 16)")
    bq.add_argument("--tokens", type=int, default=512, metavar="T", help="tokens per record, at most the context "
                    "(default: 512)")
    bq.add_argument("--new-tokens", type=int, default=64, metavar="N", help="decode tokens timed (default: 64)")
    bq.add_argument("--repeats", type=int, default=3, metavar="R", help="timed decodes, median (default: 3)")
    bq.add_argument("--gguf", nargs="+", metavar="FORMAT=FILE", help="the same weights as GGUF for llama.cpp: "
                    "float=F32.gguf int8=Q8_0.gguf int4=Q4_0.gguf (convert_hf_to_gguf.py, llama-quantize)")
    bq.add_argument("--llama-perplexity", metavar="PATH", help="llama.cpp's perplexity tool: its --kl-divergence "
                    "for Q8_0 and Q4_0 against the F32 GGUF on the same text")
    bq.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench: batch-1 decode of each GGUF")
    _report_files(bq)
    bq.set_defaults(func=_main("moeserve.bench.quant"))
    bo = bsub.add_parser("onnx", help="forward latency: torch eager fp32 vs each ONNX export on ONNX Runtime",
                         description="Export a checkpoint in each ONNX mode (parity-checked) and time the scoring "
                         "forward (ids -> logits) of the torch Engine in fp32 and of each export on ONNX Runtime's "
                         "CPU provider, at each batch size and length, and greedy generation against a fused "
                         "--kv-cache export; backends take turns in blocks.")
    bo.add_argument("--checkpoint", type=Path, metavar="DIR", help="checkpoint (default: the built-in default model)")
    bo.add_argument("--batches", type=int, nargs="+", default=[1, 8], metavar="B", help="batch sizes (default: 1 8)")
    bo.add_argument("--seqs", type=int, nargs="+", default=[1, 64], metavar="S",
                    help="tokens per row, each timed at every batch size (default: 1 64)")
    bo.add_argument("--repeats", type=int, default=30, metavar="R", help="timed rounds (default: 30)")
    bo.add_argument("--modes", nargs="+", choices=MODES, help="exports to time (default: every one the model has)")
    bo.add_argument("--new-tokens", type=int, default=64, metavar="N", help="greedy generation of N tokens by torch "
                    "and by a fused --kv-cache export, at each batch size (default: 64; 0: skip)")
    _report_files(bo)
    bo.add_argument("--quiet", action="store_true", help="no progress lines")
    bo.set_defaults(func=_main("moeserve.bench.onnx"))
    bep = bsub.add_parser("ep", help="one MoE layer's expert-parallel all-to-all, per rank (gloo on this machine)",
                          description="Start N expert-parallel ranks (processes on gloo over 127.0.0.1), each with "
                          "1/N of one MoE layer's experts and tokens of its own, and time per rank and token count: "
                          "the three all-to-alls of a layer call, the whole layer call, and the same layer with "
                          "every expert in one process.")
    bep.add_argument("--ranks", type=int, default=2, metavar="N", help="expert-parallel ranks (default: 2)")
    bep.add_argument("--tokens", type=int, nargs="+", default=[1, 32], metavar="T",
                     help="tokens each rank routes through the layer per call (default: 1 32)")
    bep.add_argument("--calls", type=int, default=200, metavar="N", help="timed calls per token count (default: 200)")
    bep.add_argument("--model", default="small", choices=sorted(PRESETS), help="the layer's sizes (default: small, "
                     "the built-in model's)")
    _report_files(bep)
    bep.add_argument("--quiet", action="store_true", help="no progress lines")
    bep.set_defaults(func=_main("moeserve.bench.ep"))
    bh = bsub.add_parser("http", help="the HTTP server under load: continuous vs batch vs batch size 1, a mixed "
                         "workload, HTTP overhead, 429s, n choices and logprobs",
                         description="Start `moeserve serve` subprocesses (one at a time) and measure: throughput "
                         "of a closed loop of concurrent clients on continuous batching, run-to-completion batches "
                         "(--scheduler batch) and --max-batch-size 1; a mixed workload of short and long requests "
                         "on continuous against batch; "
                         "the HTTP cost of one request against a direct Engine call in this process; and the 429 "
                         "answers of a small-queue server hit by a burst; n = 4 choices against 4 requests and "
                         "logprobs 5 against none. Each against its baseline in the same run.")
    bh.add_argument("--checkpoint", type=Path, metavar="DIR",
                    help="checkpoint directory (default: the built-in default model)")
    bh.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU or GPU is fast at it), float32, "
                    "bfloat16; the servers and the direct engine alike (default: auto)")
    bh.add_argument("--clients", type=int, default=32, metavar="C",
                    help="concurrent clients of the throughput loop (default: 32)")
    bh.add_argument("--duration", type=float, default=10.0, metavar="S",
                    help="timed seconds of the throughput loop, per server (default: 10)")
    bh.add_argument("--warmup", type=float, default=2.0, metavar="S",
                    help="untimed seconds of load before the throughput window (default: 2)")
    bh.add_argument("--max-tokens", type=int, default=16, metavar="M",
                    help="max_tokens of the throughput and overhead requests (default: 16)")
    bh.add_argument("--long-tokens", type=int, default=200, metavar="M",
                    help="max_tokens of the mixed workload's long requests (default: 200)")
    bh.add_argument("--batch-size", type=int, default=32, metavar="N",
                    help="--max-batch-size of the batch server and --kv-slots of the continuous one (default: 32)")
    bh.add_argument("--requests", type=int, default=50, metavar="R",
                    help="paired HTTP / direct rounds of the overhead measure (default: 50)")
    bh.add_argument("--overload", type=int, default=256, metavar="K",
                    help="requests sent at once in the overload measure (default: 256)")
    bh.add_argument("--overload-queue", type=int, default=8, metavar="N",
                    help="--max-queue of the overload server (default: 8)")
    bh.add_argument("--overload-batch-size", type=int, default=4, metavar="N",
                    help="--max-batch-size of the overload server (default: 4)")
    bh.add_argument("--overload-tokens", type=int, default=32, metavar="N",
                    help="max_tokens of the overload requests (default: 32)")
    bh.add_argument("--choice-rounds", type=int, default=20, metavar="N",
                    help="alternating rounds of the choices and log-probabilities measure (default: 20)")
    bh.add_argument("--skip-throughput", action="store_true",
                    help="leave out the continuous vs batch vs batch-1 measure")
    bh.add_argument("--skip-mixed", action="store_true", help="leave out the mixed short / long workload")
    bh.add_argument("--skip-overhead", action="store_true", help="leave out the HTTP overhead measure")
    bh.add_argument("--skip-overload", action="store_true", help="leave out the 429 measure")
    bh.add_argument("--skip-choices", action="store_true", help="leave out n=4 vs 4 requests and logprobs 5 vs none")
    _report_files(bh)
    bh.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bh.set_defaults(func=_main("moeserve.bench.http"))
    bs = bsub.add_parser("serve", help="load on any OpenAI-compatible endpoint: TTFT, ITL, latency, throughput and "
                         "goodput across concurrency levels and request rates",
                         description="Stream completions (or chat completions) from a running server at each load "
                         "level, a closed loop per --concurrency and a Poisson open loop per --rate, timing every "
                         "token's arrival. Prints a table; --json writes the report (schema: "
                         "moeserve/bench/serve_schema.json), --plot a PNG, --compare A.json B.json sets two runs "
                         "side by side. Exit 2: the endpoint cannot be used as asked; 1: it stopped answering "
                         "mid-run (the levels measured are kept).")
    bs.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000 (no /v1)")
    bs.add_argument("--model", help="the model id to ask for (default: the first of GET /v1/models)")
    bs.add_argument("--api-key", help="bearer token, if the server wants one")
    bs.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                    help="/v1/completions or /v1/chat/completions (default: completions)")
    bs.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16], metavar="C",
                    help="closed-loop levels: concurrent users (default: 1 4 16; none: only --rate)")
    bs.add_argument("--rate", type=float, nargs="*", default=[], metavar="R",
                    help="open-loop levels: requests per second, Poisson arrivals; inf sends at once (default: none)")
    bs.add_argument("--duration", type=float, default=20.0, metavar="S", help="seconds per level at most (default: 20)")
    bs.add_argument("--requests", type=int, metavar="N", help="requests per level at most (default: as many as the "
                    "duration allows; 64 for --rate inf)")
    bs.add_argument("--prompts", type=Path, metavar="FILE",
                    help="prompts: JSONL with a \"prompt\" or \"text\" field, or one per line (default: cut from the "
                    "built-in corpus to --input-len tokens)")
    bs.add_argument("--input-len", type=int, nargs="+", default=[128], metavar="N",
                    help="prompt tokens: N, or LOW HIGH for a uniform range (default: 128)")
    bs.add_argument("--output-len", type=int, nargs="+", default=[64], metavar="N",
                    help="max_tokens: N, or LOW HIGH (default: 64)")
    bs.add_argument("--ignore-eos", default="auto", choices=("auto", "on", "off"),
                    help="ask for exactly max_tokens (auto: where /v1/models says moeserve or vllm, which take it)")
    bs.add_argument("--slo-ttft", type=float, metavar="MS", help="goodput: time to first token at most this")
    bs.add_argument("--slo-itl", type=float, metavar="MS", help="goodput: mean inter-token latency at most this")
    bs.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per request (default: 300)")
    bs.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrival times (default: 0)")
    bs.add_argument("--client-procs", type=int, default=1, metavar="N",
                    help="processes the load generator runs in, each with its share of a level's users or arrivals "
                    "(default: 1). One streams ~10k tokens/s at most (~100 us of CPU a token): give more for a server "
                    "that sends more, so that the server, not the client, is measured")
    bs.add_argument("--quick", action="store_true", help="the first level of each kind, 3 s and 8 requests each")
    _report_files(bs, "latency against throughput, TTFT and ITL percentiles, as a PNG (needs matplotlib: the "
                  "bench extra)")
    bs.add_argument("--compare", type=Path, nargs=2, metavar=("A.json", "B.json"),
                    help="print two reports' levels side by side instead of running")
    bs.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bs.set_defaults(func=_main("moeserve.bench.serve"))
    bd = bsub.add_parser("docs", help="docs/benchmarks.md: every bench report in a directory, with its plot drawn "
                         "again", description="Render each *.json that a bench's --json wrote in DIR (the command "
                         "that wrote it, the machine, its tables, its plot, and the notes in NAME.md beside it), then "
                         "DIR/log.md, into one markdown page, drawing each plot again beside its JSON, so that every "
                         "number on the page can be traced to a file and a command.")
    bd.add_argument("--dir", type=Path, default=Path("docs/bench"), help="the reports (default: docs/bench)")
    bd.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"),
                    help="the page (default: docs/benchmarks.md)")
    bd.add_argument("--no-plots", action="store_true",
                    help="do not draw the plots again (the PNGs already there are linked; no matplotlib needed)")
    bd.set_defaults(func=_main("moeserve.bench.report"))
