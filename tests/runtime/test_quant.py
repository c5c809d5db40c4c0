"""Weight-only quantization (runtime/quant.py): the formats on known values, the modules against the float model
with the same (dequantized) weights, quantized checkpoints, --quantize at load and the refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from moeserve.checkpoint import CheckpointError, WEIGHTS_FILE, load_checkpoint, parameter_counts, save_checkpoint
from moeserve.cli import main as cli_main
from moeserve.config import ConfigError, MoEConfig, preset
from moeserve.runtime.backends import cpu_kernel
from moeserve.runtime.backends.plan import DispatchPlan
from moeserve.runtime.engine import Engine, EngineError, SamplingParams, load_engine
from moeserve.runtime.experts import Experts
from moeserve.runtime.loading import load_model
from moeserve.runtime.model import Transformer
from moeserve.runtime.quant import (
    QuantError, QuantExperts, QuantLinear, QuantSpec, dequantize, dequantize_int4, dequantize_int6, dequantize_int8,
    describe, pack_int4, pack_int6, quantize_int4, quantize_int6, quantize_int8, quantize_model_, unpack_int4,
    unpack_int6,
)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


# ---- the formats --------------------------------------------------------------------------------
def test_int8_on_known_values():
    w = torch.tensor([[1.0, -2.54, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_int8(w)
    assert scale.dtype == torch.float32 and q.dtype == torch.int8
    assert scale.tolist() == pytest.approx([2.54 / 127, 0.0])
    assert q.tolist() == [[50, -127, 0, 0], [0, 0, 0, 0]]  # 1 / (2.54/127) = 50; 0.01 / 0.02 = 0.5 -> 0 (half to even)
    assert torch.equal(dequantize_int8(q, scale), q.float() * scale[:, None])
    assert dequantize_int8(q, scale)[1].abs().sum() == 0  # a zero row stays zero, no division by zero


def test_int4_on_known_values():
    # one group of 32: the largest magnitude is -4, so scale = -4 / -8 = 0.5 and every multiple of 0.5 in [-4, 3.5]
    # is a level; -4 maps to u = 0
    w = torch.arange(-8, 8).repeat(2).float()[None] * 0.5
    packed, scale = quantize_int4(w, 32)
    assert packed.shape == (1, 16) and packed.dtype == torch.uint8 and scale.dtype == torch.float16
    assert scale.tolist() == [[0.5]]
    assert torch.equal(dequantize_int4(packed, scale), w)  # on the grid: exact
    u = unpack_int4(packed)
    assert u[0, :16].tolist() == list(range(16)) and u[0, 16:].tolist() == list(range(16))
    # byte j holds element j (low nibble) and element j + 16 (high nibble)
    assert packed[0].tolist() == [j | (j << 4) for j in range(16)]
    # a positive maximum maps to u = 0 too (scale negative), so +max is exact and the grid spans it
    w2 = torch.zeros(1, 32)
    w2[0, 3], w2[0, 5] = 8.0, -3.0
    p2, s2 = quantize_int4(w2, 32)
    assert s2.item() == -1.0 and dequantize_int4(p2, s2)[0, 3] == 8.0 and dequantize_int4(p2, s2)[0, 5] == -3.0


def test_int4_groups_and_round_trip_error():
    torch.manual_seed(0)
    w = torch.randn(3, 5, 128)  # stacked experts: leading dims pass through
    for group in (32, 64, 128):
        packed, scale = quantize_int4(w, group)
        assert packed.shape == (3, 5, 64) and scale.shape == (3, 5, 128 // group)
        d = scale.float()[..., None]
        g = w.reshape(3, 5, -1, group)
        err = (dequantize_int4(packed, scale) - w).abs().reshape(3, 5, -1, group)
        inside = g / d <= 7.5  # u = 15 is the top level: past it (the far end from the maximum) values clamp
        assert (err[inside] <= d.abs().expand_as(g)[inside] * 0.5 + 1e-6).all()  # round to nearest: half a step
        assert (err <= d.abs() * 1.0 + 1e-6).all()  # clamped: at most one step (Q4_0's asymmetry)
    u = torch.randint(0, 16, (4, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(u)), u)


def test_int8_round_trip_error():
    w = torch.randn(7, 33)
    q, scale = quantize_int8(w)
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[:, None] * 0.5 + 1e-7).all()


@pytest.mark.parametrize("bad, message", [
    (lambda: QuantSpec(3), "expected 8 .int8. or 4 .int4."),
    (lambda: QuantSpec(4, 48), "group size 48: expected a multiple of 32"),
    (lambda: QuantSpec.parse("int8", 32), "--group-size is int4's"),
    (lambda: QuantSpec.parse("int2"), "expected one of int8, int4"),
    (lambda: quantize_int4(torch.zeros(2, 96), 64), "group size 64 does not divide its input width 96"),
    (lambda: QuantSpec(4, 32, ("wv", "experts")), "expected names among wq, wk, wv, wo, w1, w2, w3, output"),
    (lambda: QuantSpec(8, None, ("wv",)), "keeping weights at int8 is int4's"),
    (lambda: QuantSpec.parse("int8", None, ("wv",)), "--int8-weights is int4's"),
    (lambda: QuantSpec(4, 32, ("wv", "wv")), "a name twice"),
    (lambda: QuantSpec.from_dict({"bits": 4, "group": 32, "int8": "wv"}), "optionally 'int8': \\[names\\]"),
    (lambda: QuantSpec.from_dict({"bits": 6, "group": 32}), "expected {'bits': 8 or 4"),
    (lambda: QuantSpec(4, 32, ("output",), ("output",)), "output kept at both int8 and int6"),
    (lambda: QuantSpec(8, None, (), ("output",)), "keeping weights at int6 is int4's"),
    (lambda: QuantSpec.parse("int8", None, None, ("output",)), "--int6-weights is int4's"),
    (lambda: quantize_int6(torch.zeros(2, 192)), "int6 packs 128 elements at a time, not a divisor of 192"),
])
def test_bad_formats_are_named(bad, message):
    with pytest.raises(QuantError, match=message):
        bad()


def test_int4_keeps_wk_wv_at_int8_and_the_head_at_int6_by_default():
    spec = QuantSpec.parse("int4")
    assert spec == QuantSpec(4, 32, ("wk", "wv"), ("output",))
    assert spec.for_weight("wk", 64) == spec.for_weight("wv", 64) == QuantSpec(8)
    assert spec.for_weight("output", 256) == QuantSpec(6, 32)
    assert spec.for_weight("output", 64) == QuantSpec(8)  # int6 packs 128 elements at a time: int8 for other widths
    assert spec.for_weight("wq", 64) == spec.for_weight("experts", 64) == QuantSpec(4, 32)
    assert QuantSpec.parse("int4", 64, (), ()) == QuantSpec(4, 64)  # none and none: every weight at int4
    # a name given to one list leaves the other's default, less that name
    assert QuantSpec.parse("int4", int8=("wk", "wv", "output")) == QuantSpec(4, 32, ("wk", "wv", "output"))
    assert QuantSpec.parse("int4", int6=("output", "wv")) == QuantSpec(4, 32, ("wk",), ("output", "wv"))
    assert spec.as_dict() == {"bits": 4, "group": 32, "int8": ["wk", "wv"], "int6": ["output"]}
    assert QuantSpec(4, 32).as_dict() == {"bits": 4, "group": 32}  # uniform configs are what they were
    assert QuantSpec.from_dict(spec.as_dict()) == spec and QuantSpec.from_dict({"bits": 8, "group": None}) == \
        QuantSpec(8)
    assert describe(spec.as_dict()) == "int4 (group 32; wk, wv at int8; output at int6)"
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("tiny"), d_model=128, n_heads=4, n_kv_heads=2)  # a head 128 wide: int6
    model = Transformer(cfg)
    quantize_model_(model, spec)
    assert model.layers[0].attention.wv.spec == QuantSpec(8) and model.output.spec == QuantSpec(6, 32)
    assert model.layers[0].attention.wq.spec == model.layers[0].ffn.experts.spec == QuantSpec(4, 32)
    assert model.layers[0].attention.wv.qweight.dtype == torch.int8
    assert model.output.qweight.shape == (cfg.vocab_size, 96)
    # a checkpoint's empty model builds the same modules from its config
    empty = Transformer(model.cfg)
    assert {k: (v.dtype, v.shape) for k, v in empty.state_dict().items()} == \
        {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}


def test_int6_round_trips_known_values_and_packs_as_documented():
    levels = torch.arange(64, dtype=torch.uint8).repeat(2)  # 128 elements: every level twice
    packed = pack_int6(levels[None])[0]
    assert packed.shape == (96,) and torch.equal(unpack_int6(packed[None])[0], levels)
    for m in range(64):  # nibble byte m: elements 32 r + j and 32 r + 16 + j (m = 16 r + j); crumbs as quant.py says
        r, j = divmod(m, 16)
        lo, hi = levels[32 * r + j], levels[32 * r + 16 + j]
        assert packed[m] == (lo & 15) | ((hi & 15) << 4)
        crumb = int(packed[64 + m % 32]) >> (4 * (m // 32))
        assert (crumb & 3, (crumb >> 2) & 3) == (int(lo) >> 4, int(hi) >> 4)
    # one group: m = -3.2 is the largest magnitude, scale = fp16(-3.2 / -32) = 0.1, levels round(w / 0.1) + 32
    w = torch.zeros(1, 128)
    w[0, :4] = torch.tensor([-3.2, 0.1, 3.1, 0.0])
    q, scale = quantize_int6(w)
    assert scale[0, 0].item() == torch.tensor(0.1, dtype=torch.float16).item() and scale[0, 1:].eq(0).all()
    assert unpack_int6(q)[0, :4].tolist() == [0, 33, 63, 32]
    assert torch.equal(dequantize_int6(q, scale)[0, :4], (torch.tensor([-32.0, 1, 31, 0]) * scale[0, 0].float()))


def test_config_validates_quantization():
    assert MoEConfig(quantization={"bits": 4, "group": 64}).quantization == {"bits": 4, "group": 64}
    keep = {"bits": 4, "group": 32, "int8": ["wk", "wv", "output"]}
    assert MoEConfig(quantization=keep).quantization == keep
    for bad in ({"bits": 4, "group": None}, {"bits": 8, "group": 32}, {"bits": 3, "group": None}, {"bits": 8},
                {"bits": True, "group": None}, "int8", {"bits": 8, "group": None, "int8": []},
                {"bits": 4, "group": 32, "int8": "wv"}, {"bits": 4, "group": 32, "int8": [1]},
                {"bits": 4, "group": 32, "extra": 1}):
        with pytest.raises(ConfigError, match="config field 'quantization'"):
            MoEConfig(quantization=bad)


# ---- the modules --------------------------------------------------------------------------------
def _dequantized_float_model(model: Transformer, quantized: Transformer) -> Transformer:
    """The float model whose weights are the quantized model's, dequantized: the reference it must equal."""
    ref = copy.deepcopy(model)
    for (parent, name), (qparent, _) in zip(ref.quantizable(), quantized.quantizable()):
        m, q = getattr(parent, name), getattr(qparent, name)
        with torch.no_grad():
            if isinstance(m, Experts):
                for w in ("w1", "w2", "w3"):
                    getattr(m, w).copy_(dequantize(getattr(q, f"{w}_qweight"), getattr(q, f"{w}_scale"), q.spec))
            elif name == "output" and ref.cfg.tie_embeddings:  # the tied head: its own weight, once quantized
                head = torch.nn.Linear(q.in_features, q.out_features, bias=False)
                head.weight.copy_(q.dequantized(torch.float32))
                setattr(parent, name, head)
            else:
                m.weight.copy_(q.dequantized(torch.float32))
    return ref


@pytest.mark.parametrize("router", ["softmax", "xmoe", "vq"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_equals_the_float_model_on_its_dequantized_weights(router, fmt):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router=router, moe_layers=[1])).eval()  # a dense FFN layer too
    quantized = copy.deepcopy(model)
    quantize_model_(quantized, QuantSpec.parse(fmt))
    assert quantized.cfg.quantization == QuantSpec.parse(fmt).as_dict()
    kinds = {type(getattr(p, n)) for p, n in quantized.quantizable()}
    assert kinds == {QuantLinear, QuantExperts}
    assert type(quantized.layers[1].ffn.router.gate if router != "xmoe" else quantized.layers[1].ffn.router.proj) \
        is torch.nn.Linear  # routers stay in full precision
    ids = torch.randint(0, 259, (2, 24))
    with torch.inference_mode():
        got = quantized(ids).logits
        want = _dequantized_float_model(model, quantized)(ids).logits
        float_logits = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - float_logits).abs().max() > 1e-4  # and it is not the float model


def test_scales_survive_dtype_casts_bit_for_bit():
    torch.manual_seed(0)
    for fmt in ("int8", "int4"):
        model = Transformer(preset("tiny"))
        quantize_model_(model, QuantSpec.parse(fmt))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.to(torch.bfloat16).half().float()
        for k, v in model.state_dict().items():
            if k.endswith(("scale", "qweight")):
                assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
        assert model.tok_embeddings.weight.dtype == torch.float32


def test_quantizing_twice_is_refused():
    model = Transformer(preset("tiny"))
    quantize_model_(model, QuantSpec.parse("int8"))
    with pytest.raises(QuantError, match=r"already quantized \(int8\)"):
        quantize_model_(model, QuantSpec.parse("int4"))


def test_a_group_that_does_not_divide_a_width_names_the_weight():
    model = Transformer(preset("tiny"))  # d_model 64
    with pytest.raises(QuantError, match=r"layers\.0\.attention\.wq \[64, 64\]: group size 128 does not divide"):
        quantize_model_(model, QuantSpec(4, 128))
    assert model.cfg.quantization is None and type(model.layers[0].attention.wq) is torch.nn.Linear  # untouched


# ---- checkpoints and the engine -----------------------------------------------------------------
PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A"]


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", router="xmoe"))
    return save_checkpoint(tmp_path_factory.mktemp("quant") / "tiny", model.cfg, model.state_dict())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_checkpoint_round_trips_bit_for_bit(float_ckpt, tmp_path, fmt):
    out = tmp_path / fmt
    p = subprocess.run([sys.executable, "-m", "moeserve.cli", "quantize", str(float_ckpt), "--bits", fmt[3:], "--out",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    engine = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt)
    loaded = load_checkpoint(out)
    assert loaded.config.quantization == QuantSpec.parse(fmt).as_dict()
    state = engine.model.state_dict()
    assert set(loaded.state_dict) == set(state)
    for k, t in loaded.state_dict.items():
        assert t.dtype == state[k].dtype and torch.equal(t, state[k]), k
    # bf16 activations: the scales still load as stored
    bf16 = Engine.load(out, dtype="bfloat16", device="cpu")
    assert bf16.model.layers[0].attention.wq.scale.dtype == (torch.float32 if fmt == "int8" else torch.float16)
    # the parameters counted are the float model's (int4's weights two a byte, those kept at int8 one), and the tied
    # head's own quantized copy
    shapes = {k: tuple(t.shape) for k, t in loaded.state_dict.items()}
    float_ckpt_ = load_checkpoint(float_ckpt)
    float_shapes = {k: tuple(t.shape) for k, t in float_ckpt_.state_dict.items()}
    got, want = parameter_counts(loaded.config, shapes), parameter_counts(float_ckpt_.config, float_shapes)
    head = loaded.config.vocab_size * loaded.config.d_model if loaded.config.tie_embeddings else 0
    assert got == {k: v + (head if k != "experts" else 0) for k, v in want.items()}


def test_a_tampered_quantized_checkpoint_is_refused(float_ckpt, tmp_path):
    model = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize="int4").model
    out = save_checkpoint(tmp_path / "q", model.cfg, model.state_dict())
    data = bytearray((out / WEIGHTS_FILE).read_bytes())
    data[-5] ^= 1
    (out / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        Engine.load(out, dtype="float32", device="cpu")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_generation_and_scoring_on_a_quantized_model(float_ckpt, fmt):
    """On torch's kernels (QuantLinear's own forward: weight-only), a quantized model gives the float engine's tokens
    and scores on the dequantized weights; continuous batching (rows of any lengths) runs on it."""
    engine = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt, plan=DispatchPlan())
    assert engine.runner.name == "eager"
    ref_model = _dequantized_float_model(load_model(float_ckpt)[0], engine.model)
    ref = Engine.from_model(ref_model, engine.tokenizer, plan=DispatchPlan())
    params = SamplingParams(12, ignore_eos=True)
    got, want = engine.complete(PROMPTS, params), ref.complete(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(engine.score(PROMPTS), ref.score(PROMPTS)):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_c_kernel_runs_quantized_models_batch_invariant(float_ckpt, fmt):
    """Where the C kernel builds, a quantized model runs on its integer GEMMs (activations quantized per 32-block,
    as llama.cpp does), a decode step in one call: each prompt's tokens are those it gets alone, and its scores are
    the weight-only reference's within the activations' rounding."""
    engine = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt)
    if cpu_kernel.unavailable_reason() is not None:
        assert engine.runner.name == "eager" and "dequantized by torch" in engine.plan.reason
        pytest.skip(f"the C kernel is not available: {cpu_kernel.unavailable_reason()}")
    assert engine.runner.name == "cpu-kernel" and engine.runner.step is not None
    params = SamplingParams(12, ignore_eos=True)
    together = [c.token_ids for c in engine.complete(PROMPTS, params)]
    assert together == [engine.complete([p], params)[0].token_ids for p in PROMPTS]
    eager = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize=fmt, plan=DispatchPlan())
    for a, b in zip(engine.score(PROMPTS), eager.score(PROMPTS)):
        assert a.logprob == pytest.approx(b.logprob, rel=2e-3)
        assert a.logprob != b.logprob  # the activations' quantization shows


def cli_exit(argv: list[str], capsys) -> tuple[int, str]:
    """`moeserve ARGV` in this process (an argparse refusal is its SystemExit): exit code and stderr."""
    capsys.readouterr()
    try:
        code = cli_main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_quantize_refusals(float_ckpt, tmp_path, capsys):
    with pytest.raises(QuantError, match="format 'int3'"):
        Engine.load(float_ckpt, dtype="float32", device="cpu", quantize="int3")
    with pytest.raises(EngineError, match="an ONNX export runs as it was exported"):
        load_engine(tmp_path / "m.onnx", quantize="int8")
    for args, message in (
        (["quantize", str(float_ckpt), "--bits", "3", "--out", str(tmp_path / "x")], "invalid choice: 3"),
        (["quantize", str(float_ckpt), "--bits", "4", "--group-size", "40", "--out", str(tmp_path / "x")],
         "group size 40: expected a multiple of 32"),
        (["quantize", str(float_ckpt), "--bits", "8", "--group-size", "32", "--out", str(tmp_path / "x")],
         "--group-size is int4's"),
        (["quantize", str(float_ckpt), "--bits", "4", "--int8-weights", "wv,router", "--out", str(tmp_path / "x")],
         "expected names among wq, wk, wv, wo, w1, w2, w3, output"),
        (["quantize", str(float_ckpt), "--bits", "8", "--int8-weights", "wv", "--out", str(tmp_path / "x")],
         "--int8-weights is int4's"),
        (["quantize", str(float_ckpt), "--bits", "8", "--int6-weights", "output", "--out", str(tmp_path / "x")],
         "--int6-weights is int4's"),
        (["quantize", str(float_ckpt), "--bits", "4", "--int6-weights", "output,embedding", "--out",
          str(tmp_path / "x")], "expected names among wq, wk, wv, wo, w1, w2, w3, output"),
        (["quantize", str(float_ckpt), "--bits", "4", "--int8-weights", "wk,output", "--int6-weights", "output",
          "--out", str(tmp_path / "x")], "output kept at both int8 and int6"),
        (["generate", str(float_ckpt), "--quantize", "int2"], "invalid choice: 'int2'"),
        (["serve", str(float_ckpt), "--ray", "--quantize", "int8"], "--ray: quantize the checkpoint first"),
    ):
        code, err = cli_exit(args, capsys)
        assert code == 2 and message in err, (args, err)
    assert not (tmp_path / "x").exists()
    once = tmp_path / "once"
    assert cli_exit(["quantize", str(float_ckpt), "--bits", "8", "--out", str(once)], capsys)[0] == 0
    code, err = cli_exit(["quantize", str(once), "--bits", "4", "--out", str(tmp_path / "twice")], capsys)
    assert code == 2 and "is already quantized (int8)" in err
    code, err = cli_exit(["generate", str(once), "--quantize", "int8", "--max-tokens", "2"], capsys)
    assert code == 2 and "already quantized (int8)" in err


def test_quantize_keeps_the_weights_its_flags_name(tmp_path, capsys):
    """--int8-weights and --int6-weights reach the checkpoint's config, its modules and `moeserve inspect`: by default
    wk, wv at int8 and the head (128 wide here: int6 packs 128 elements at a time) at int6; a name given to one list
    leaves the other's default less that name; none is no weight."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(preset("tiny"), d_model=128, n_heads=4, n_kv_heads=2))
    ckpt = save_checkpoint(tmp_path / "f", model.cfg, model.state_dict())
    for flags, int8, int6, words in (
        ([], ["wk", "wv"], ["output"], "int4 (group 32; wk, wv at int8; output at int6)"),
        (["--int6-weights", "wv,output"], ["wk"], ["wv", "output"], "int4 (group 32; wk at int8; wv, output at int6)"),
        (["--int8-weights", "none", "--int6-weights", "none"], None, None, "int4 (group 32)"),
    ):
        out = tmp_path / "q"
        code, err = cli_exit(["quantize", str(ckpt), "--bits", "4", *flags, "--out", str(out), "--overwrite"], capsys)
        assert code == 0, err
        loaded = load_checkpoint(out)
        assert loaded.config.quantization == {"bits": 4, "group": 32} | ({"int8": int8} if int8 else {}) | (
            {"int6": int6} if int6 else {})
        head = loaded.state_dict["output.qweight"]
        assert head.shape == (model.cfg.vocab_size, 96 if int6 else 64), flags  # int6: 96 bytes a 128 elements
        assert cli_main(["inspect", str(out)]) == 0
        printed = capsys.readouterr().out
        assert f"weights: {words}\n" in printed, printed


def test_score_with_quantize_records_it_and_a_resume_must_match(float_ckpt, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "text": f"line {i} of text"}) + "\n" for i in range(5)))
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "moeserve.cli", "score", str(float_ckpt), "--input", str(inp), "--output", str(out),
           "--quiet", "--chunk-size", "2"]
    p = subprocess.run([*cli, "--quantize", "int4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    engine = Engine.load(float_ckpt, dtype="float32", device="cpu", quantize="int4")
    want = engine.score([f"line {i} of text" for i in range(5)])
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["logprob"] for g in got] == pytest.approx([w.logprob for w in want], rel=1e-6)
    # what a resume must match names the quantization, so a run resumed with other weights is refused
    from moeserve.scoring import ModelFacts, ScoreConfig, _differences, _identity, scan_input

    cfg, info = ScoreConfig(inp, out), scan_input(inp)
    int4 = _identity(cfg, info, ModelFacts.of(engine))
    int8 = _identity(cfg, info, ModelFacts.of(Engine.load(float_ckpt, dtype="float32", device="cpu", quantize="int8")))
    assert int4["settings"]["quantization"] == {"bits": 4, "group": 32, "int8": ["wk", "wv"], "int6": ["output"]}
    assert _differences(int4, int8) == ["quantization: {'bits': 4, 'group': 32, 'int8': ['wk', 'wv'], 'int6': "
                                        "['output']} in the run, {'bits': 8, 'group': None} now"]
