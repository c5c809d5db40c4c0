"""`moeserve convert`: a Hugging Face Mixtral directory written as a moeserve checkpoint gives the same logits and
tokens, keeps its tokenizer and chat template files, loads its experts as the file's own pages, and refuses to
overwrite or to write over its source."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.bench.engine import write_mixtral
from moeserve.checkpoint import CheckpointError, load_checkpoint
from moeserve.convert import convert
from moeserve.runtime.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = write_mixtral(tmp_path_factory.mktemp("convert") / "mixtral", "tiny",
                         num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300,
                         num_attention_heads=4, num_key_value_heads=2)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return path


def test_the_converted_checkpoint_is_the_mixtral(mixtral, tmp_path):
    out = convert(mixtral, tmp_path / "converted")
    assert (out / "moeserve.json").is_file() and (out / "chat_template.jinja").read_text().startswith("{% for")
    ckpt = load_checkpoint(out, dtype=None)
    assert any(name.endswith("experts.w1") for name in ckpt.state_dict)  # stacked once, here
    ids = torch.tensor([[1, 5, 9, 200, 3, 7]])
    src, got = Engine.load(mixtral, dtype="float32"), Engine.load(out, dtype="float32")
    assert torch.equal(got.forward(ids), src.forward(ids))
    rows = [[1, 5, 9], [1, 200, 3, 7, 11]]
    params = SamplingParams(max_new_tokens=6)
    assert [c.token_ids for c in got.complete(rows, params)] == [c.token_ids for c in src.complete(rows, params)]
    bf16 = convert(mixtral, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["d_model"] == 64
    assert next(iter(load_checkpoint(bf16, dtype=None).state_dict.values())).dtype == torch.bfloat16


def test_refusals(mixtral, tmp_path, capsys):
    out = convert(mixtral, tmp_path / "once")
    with pytest.raises(CheckpointError, match="exists; --overwrite replaces it"):
        convert(mixtral, out)
    assert convert(mixtral, out, overwrite=True) == out
    with pytest.raises(CheckpointError, match="must not be the checkpoint it is converted from"):
        convert(out, out, overwrite=True)
    from moeserve.cli import main  # the exit status of a real process is main()'s: tests/test_cli.py

    assert main(["convert", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "moeserve convert: error:" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_scoring_a_hugging_face_directory_suggests_converting_it(mixtral, tmp_path, capsys):
    from moeserve.cli import main

    inp = tmp_path / "in.txt"
    inp.write_text("a b c\n")
    out = convert(mixtral, tmp_path / "converted")
    for path, hinted in ((mixtral, True), (out, False)):
        main(["score", str(path), "--input", str(inp), "--output", str(tmp_path / f"{hinted}.jsonl"), "--quiet"])
        err = capsys.readouterr().err
        assert (f"moeserve convert {path} --out DIR" in err) == hinted, err
