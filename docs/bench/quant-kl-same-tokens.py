"""The int4 recipe's accuracy against llama.cpp's Q4_0 on the same weights *and the same tokens* (docs/bench/log.md,
"The int4 recipe"). `llama-perplexity --kl-divergence` scores its own token windows, so its KL and ours are not
comparable numbers; here llama.cpp's quantized GGUF files are dequantized (gguf-py, weight-only) into the moeserve
model and scored by moeserve bench quant's own harness beside moeserve's formats, in one run.

    PYTHONPATH=. python docs/bench/quant-kl-same-tokens.py CKPT F32.gguf Q8_0.gguf Q4_0.gguf [RECORDS]

CKPT: the moeserve conversion of the Mixtral the GGUFs were made from (convert_hf_to_gguf.py, llama-quantize).
Needs the `gguf` package (llama.cpp's gguf-py). The F32 GGUF is checked to hold exactly CKPT's weights.
"""

import sys

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from moeserve.bench.quant import held_out_records, next_token_logp
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.engine import Engine
from moeserve.runtime.quant import QuantSpec, describe

NAMES = {"attn_q": "attention.wq.weight", "attn_k": "attention.wk.weight", "attn_v": "attention.wv.weight",
         "attn_output": "attention.wo.weight", "ffn_gate_exps": "ffn.experts.w1", "ffn_up_exps": "ffn.experts.w3",
         "ffn_down_exps": "ffn.experts.w2", "ffn_gate_inp": "ffn.router.gate.weight",
         "attn_norm": "attention_norm.weight", "ffn_norm": "ffn_norm.weight"}
TOP = {"token_embd.weight": "tok_embeddings.weight", "output.weight": "output.weight",
       "output_norm.weight": "norm.weight"}
EAGER = DispatchPlan()  # torch's kernels, weight-only: how the GGUF weights are scored


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k row permutation (for llama.cpp's RoPE layout), undone."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_into(model, path: str) -> dict[str, int]:
    """Every tensor of the GGUF, dequantized to float32, into the model's state; its tensor types counted."""
    sd, types, cfg = model.state_dict(), {}, model.cfg
    with torch.no_grad():
        for t in GGUFReader(path).tensors:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            if t.name.startswith("blk."):
                _, i, rest = t.name.split(".", 2)
                base = rest.rsplit(".", 1)[0]
                key = f"layers.{i}.{NAMES[base]}"
                w = unpermute(w, cfg.n_heads) if base == "attn_q" else unpermute(w, cfg.n_kv_heads) \
                    if base == "attn_k" else w
            else:
                key = TOP[t.name]
            sd[key].copy_(w.reshape(sd[key].shape))
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return types


def main(ckpt: str, f32: str, q8: str, q4: str, n_records: int = 6) -> None:
    torch.set_num_threads(2)
    base = Engine.load(ckpt, dtype="float32", device="cpu", plan=EAGER)
    records = [base.encode(t, any_length=True) for t in held_out_records(base, n_records, 512)]
    ref = [next_token_logp(base, r) for r in records]
    print(f"{len(records)} held-out records, {sum(len(r) - 1 for r in records)} tokens scored")

    def score(engine, what: str) -> None:
        kl = agree = n = 0
        for r, lp0 in zip(records, ref):
            lp = next_token_logp(engine, r)
            kl += (lp0.exp() * (lp0 - lp)).sum().item()
            agree += (lp0.argmax(-1) == lp.argmax(-1)).sum().item()
            n += lp.shape[0]
        print(f"| {what} | {kl / n:.5f} | {agree / n:.4f} |", flush=True)

    print("| weights | mean KL | top-1 agreement |\n| --- | ---: | ---: |")
    for spec in (QuantSpec(8), QuantSpec(4, 32), QuantSpec(4, 32, ("wk", "wv", "output")), QuantSpec.parse("int4")):
        name = describe(spec.as_dict())
        score(Engine.load(ckpt, dtype="float32", device="cpu", quantize=spec), f"moeserve {name}, C kernel")
        score(Engine.load(ckpt, dtype="float32", device="cpu", quantize=spec, plan=EAGER),
              f"moeserve {name}, weight-only")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    load_gguf_into(base.model, f32)
    drift = max((base.model.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    assert drift == 0.0, f"{f32} does not hold {ckpt}'s weights (max difference {drift})"
    for path in (q8, q4):
        types = load_gguf_into(base.model, path)
        score(base, f"llama.cpp {path.rsplit('/', 1)[-1]} ({', '.join(f'{v} {k}' for k, v in sorted(types.items()))}),"
                    f" weight-only")


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
