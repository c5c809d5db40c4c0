"""Minimal KV-cached sampling for one prompt: prefill once, then one token per forward.

The engine (engine.py, later) builds batched generation on the same model calls; this is the
smallest correct loop, used to show what a freshly trained model writes.
"""

from __future__ import annotations

import torch

from moeserve.runtime.model import Transformer
from moeserve.tokenizer import Tokenizer


@torch.no_grad()
def sample(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 64,
           temperature: float = 0.8, top_k: int | None = 40, seed: int = 0) -> str:
    """Continue `prompt`; temperature 0 is greedy. Returns the continuation only."""
    cfg = model.cfg
    ids = tokenizer.encode(prompt, bos=True)
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    max_new_tokens = max(0, min(max_new_tokens, cfg.max_seq_len - len(ids)))
    if len(ids) >= cfg.max_seq_len:
        raise ValueError(f"prompt is {len(ids)} tokens; the model's context is {cfg.max_seq_len}")
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    model.setup_cache(1, len(ids) + max_new_tokens)
    try:
        x = torch.tensor([ids])
        logits = model(x, torch.arange(len(ids))).logits[0, -1]
        out: list[int] = []
        for i in range(max_new_tokens):
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                scaled = logits.float() / temperature
                if top_k is not None:
                    kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                nxt = int(torch.multinomial(scaled.softmax(-1), 1, generator=gen))
            if nxt == tokenizer.eos_id:
                break
            out.append(nxt)
            pos = len(ids) + i
            if i + 1 < max_new_tokens:
                logits = model(torch.tensor([[nxt]]), torch.tensor([pos])).logits[0, -1]
        return tokenizer.decode(out)
    finally:
        model.clear_cache()
