"""Tiny Hugging Face directories written by transformers itself, with a byte-level BPE tokenizer.json so that text
requests tokenize: what the expert-parallel tests (test_expert_parallel.py, test_expert_replicas.py) serve beside
moeserve's own checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch


def byte_level_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer.json written to a new directory `path`, so the ranks' text requests tokenize; its
    vocabulary size (token 0 is <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x\nimport os\n"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def qwen2_moe(path: Path) -> Path:
    """A tiny Qwen2-MoE written by transformers (context 64, 2 MoE layers of 4 experts, top-2, as tiny)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    vocab = byte_level_tokenizer(path)
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=0,
        pad_token_id=0)).save_pretrained(path)
    return path


def mixtral(path: Path) -> Path:
    """A tiny Mixtral written by transformers (context 64, 2 MoE layers of 4 experts, top-2, as tiny): each expert's
    w1, w2, w3 its own tensors in the file, which a rank reads as safetensors slices of its experts only."""
    from ..test_hf_mixtral import hf_mixtral

    vocab = byte_level_tokenizer(path)
    hf_mixtral(path, vocab_size=vocab, max_position_embeddings=64, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    return path


def gpt_oss(path: Path) -> Path:
    """A tiny gpt-oss written by transformers (context 64, 2 MoE layers of 4 experts, top-2; the first layer sliding
    with a window of 8), as tests/test_hf_gpt_oss.py writes them so that greedy tokens mean something: weights of
    std 0.2, a SwiGLU limit of 1.5 that the experts' pre-activations cross, and biases and sinks large enough to
    matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    vocab = byte_level_tokenizer(path)
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        swiglu_limit=1.5, initializer_range=0.2, bos_token_id=None, eos_token_id=0, pad_token_id=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path
