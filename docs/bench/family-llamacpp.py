"""Batch-1 decode of a Qwen3-MoE directory on moeserve against llama-bench on the same weights, alternated round by
round (issue 41's llama.cpp comparison; the method of quant-alternated.py, whose notes apply).

    # a random 712M Qwen3-MoE (Qwen3-30B-A3B's shape, scaled: 32 experts, top-4, head_dim 128 over hidden 1024,
    # QK-norm), with a 32000-token SentencePiece vocabulary copied from TOKENIZER_DIR, and its GGUFs
    PYTHONPATH=. python docs/bench/family-llamacpp.py make OUT_DIR TOKENIZER_DIR LLAMA_CPP_DIR
    PYTHONPATH=. python docs/bench/family-llamacpp.py run ROUNDS OUT_DIR LLAMA_CPP_DIR

llama.cpp's converter reads a Qwen vocabulary as GPT-2 BPE and refuses one whose pre-tokenizer it does not know; the
vocabulary here is SentencePiece's, so `make` points the converter's set_vocab at its SentencePiece reader. The
benchmark feeds token ids: the vocabulary's kind touches no weight. LLAMA_CPP_DIR holds convert_hf_to_gguf.py,
gguf-py, conversion/ and build/bin/llama-bench.
"""

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

QWEN3 = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=1024, head_dim=128,
             num_attention_heads=16, num_key_value_heads=4, intermediate_size=3072, moe_intermediate_size=768,
             num_experts=32, num_experts_per_tok=4, num_hidden_layers=8, norm_topk_prob=True,
             max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
CONVERT = r'''
import runpy, sys
llama = sys.argv.pop(1)
sys.path[:0] = [llama, llama + "/gguf-py"]
import conversion.qwen as q
q.Qwen2MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv[0] = llama + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
'''
WORKER = r'''
import sys, time
from moeserve.runtime.engine import Engine, SamplingParams
e = Engine.load(sys.argv[1], dtype=sys.argv[2], device="cpu")
prompt = list(range(100, 116))
def run(n):
    t0 = time.perf_counter(); e.complete([prompt], SamplingParams(n, ignore_eos=True)); return time.perf_counter() - t0
run(4)
print("ready", e.runner.name, "one-call step" if getattr(e.runner, "step", None) else "ops", flush=True)
for line in sys.stdin:
    one, whole = run(1), run(65)
    print(64 / (whole - one), flush=True)
'''
GGUF = {"float32": "f32", "bfloat16": "bf16"}


def make(out: Path, tokenizer_dir: Path, llama: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **QWEN3)).eval()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    for outtype in GGUF.values():
        subprocess.run([sys.executable, "-c", CONVERT, llama, str(out), "--outtype", outtype, "--outfile",
                        f"{out}-{outtype}.gguf"], check=True)


def run(rounds: int, out: str, llama: str) -> None:
    alternate = importlib.import_module("quant-alternated").alternate  # this directory's, by file name
    alternate([(dtype, [out, dtype], {}, f"{llama}/build/bin/llama-bench", f"{out}-{outtype}.gguf",
                f"{outtype.upper()} GGUF") for dtype, outtype in GGUF.items()], rounds, WORKER, "dtype")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        run(int(sys.argv[2]), sys.argv[3], sys.argv[4])
