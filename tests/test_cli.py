"""The `moeserve` command as a user runs it: real processes, exit codes, messages."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, check=False, env=None):
    p = subprocess.run([sys.executable, "-m", "moeserve.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=None if env is None else {**os.environ, **env})
    if check and p.returncode != 0:
        raise AssertionError(p.stderr)
    return p


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "ckpt"
    run("train", "--preset", "tiny", "--router", "xmoe", "--steps", "30", "--batch-size", "8", "--seq-len", "64",
        "--eval-every", "30", "--out", out, "--quiet", check=True)
    return out


def test_train_writes_a_checkpoint_and_prints_metrics(ckpt):
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "moeserve.json").is_file()
    manifest = json.loads((ckpt / "moeserve.json").read_text())
    assert manifest["metrics"]["val_bits_per_byte"] < manifest["metrics"]["unigram_bits_per_byte"]


def test_inspect(ckpt):
    p = run("inspect", ckpt, check=True)
    assert 'router = "xmoe"' in p.stdout
    assert "active" in p.stdout and "sha256" in p.stdout


def test_generate_is_deterministic_and_continues_the_prompt(ckpt):
    a = run("generate", ckpt, "--prompt", "def ", "--max-tokens", "24", "--temperature", "0", check=True)
    b = run("generate", ckpt, "--prompt", "def ", "--max-tokens", "24", "--temperature", "0", check=True)
    assert a.stdout == b.stdout and a.stdout.startswith("def ") and len(a.stdout) > len("def \n")


def test_generate_in_bf16_prints_text_on_any_cpu(ckpt):
    """bf16 on this CPU's own path: packed where oneDNN packs bf16, plain elsewhere (AVX2-only CPUs)."""
    p = run("generate", ckpt, "--prompt", "def ", "--max-tokens", "16", "--temperature", "0", "--dtype", "bfloat16",
            check=True)
    assert p.stdout.startswith("def ") and len(p.stdout) > len("def \n") and "Traceback" not in p.stderr


def test_generate_in_bf16_without_onednn_bf16(ckpt, monkeypatch, capsys):
    """The fallback side of the probe, forced on every machine: unpacked bf16 weights, same command."""
    from moeserve.cli import main
    from moeserve.runtime import device

    monkeypatch.setattr(device, "onednn_bf16_available", lambda: False)
    assert main(["generate", str(ckpt), "--prompt", "def ", "--max-tokens", "16", "--temperature", "0",
                 "--dtype", "bfloat16", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_generate_calibrates_once_per_machine_and_says_so(ckpt, tmp_path, monkeypatch, capsys):
    env = {"MOESERVE_CACHE": str(tmp_path), "MOESERVE_CALIBRATION": "auto"}
    args = ("generate", ckpt, "--max-tokens", "4", "--temperature", "0", "--dtype", "float32")
    first = run(*args, env=env, check=True)
    assert "moeserve: calibrated MoE dispatch (D 64, F 128, E 4, k 2, swiglu, float32)" in first.stderr
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    second = run(*args, env=env, check=True)
    assert "calibrated" not in second.stderr and second.stdout == first.stdout
    assert "calibrated MoE dispatch" in run(*args, "--calibrate", env=env, check=True).stderr
    from moeserve.cli import main  # a bad value is refused before the model loads: here, not in a fourth process

    monkeypatch.setenv("MOESERVE_CALIBRATION", "maybe")
    assert main(list(map(str, args))) == 2
    assert "$MOESERVE_CALIBRATION = 'maybe': expected one of auto, off, redo" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--preset", "tiny", "--set", "top_k=99", "--out", "{tmp}/x"], "top_k"),
        (["train", "--preset", "tiny", "--set", "nonsense=1", "--out", "{tmp}/x"], "nonsense"),
        (["train", "--preset", "tiny", "--steps", "0", "--out", "{tmp}/x"], "steps"),
        (["train", "--preset", "tiny", "--data", "{tmp}/missing.txt", "--out", "{tmp}/x"], "missing.txt"),
        (["train", "--preset", "tiny", "--data", "{tmp}/bad.jsonl", "--out", "{tmp}/x"], "bad.jsonl"),
        (["inspect", "{tmp}/nowhere"], "nowhere"),
        (["generate", "{tmp}/nowhere"], "nowhere"),
        (["generate", "{tmp}/nowhere", "--dtype", "int4"], "int4"),
    ],
)
def test_user_errors_exit_2_with_a_named_cause(tmp_path, args, needle, capsys):
    """In this process (a subprocess each cost ~4 s of imports); the tests around it check that a real
    process's exit status is main()'s."""
    from moeserve.cli import main

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    try:
        status = main([a.format(tmp=tmp_path) for a in args])
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert needle in err and "Traceback" not in err


def test_train_refuses_existing_out_dir(ckpt):
    p = run("train", "--preset", "tiny", "--steps", "1", "--out", ckpt, "--quiet")
    assert p.returncode == 2 and "already exists" in p.stderr


def test_unknown_router_is_an_argparse_error():
    p = run("train", "--router", "banana", "--out", "x")
    assert p.returncode == 2 and "banana" in p.stderr


@pytest.mark.parametrize("content, why", [(None, "cannot read"), ("{% for m in messages %}", "not valid Jinja2")])
def test_serve_names_a_bad_chat_template_before_loading(tmp_path, content, why, capsys):
    from moeserve.cli import main

    template = tmp_path / "chat.jinja"
    if content is not None:
        template.write_text(content)
    assert main(["serve", str(tmp_path / "no-such-checkpoint"), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert why in err and str(template) in err, err


def test_serve_flags_default_to_the_config_dataclasses():
    """No flag restates a default: `moeserve serve` with none gives exactly ServeConfig(), and --help shows it."""
    from moeserve.cli import build_parser
    from moeserve.cli_serve import serve_config
    from moeserve.serve.config import BatchConfig, ExpertParallelOptions, ServeConfig

    assert serve_config(build_parser().parse_args(["serve"])) == ServeConfig()
    assert ServeConfig().batch == BatchConfig()
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command").choices["serve"]
    text = " ".join(sub.format_help().split())
    cfg = ServeConfig()
    assert f"port (default: {cfg.port})" in text
    assert f"(default: {cfg.kv_slots})" in text and f"(default: {cfg.batch.max_batch_tokens})" in text
    assert f"batch (default: {cfg.batch.wait_s * 1000:g})" in text and "(default: 1 MiB)" in text
    # the --ray flags parse to None when not given, so that the options take ExpertParallelOptions' own defaults
    args, ep = build_parser().parse_args(["serve"]), ExpertParallelOptions()
    assert (args.expert_parallel, args.data_parallel_groups, args.cpus_per_rank, args.placement, args.redundant_experts,
            args.rebalance_every) == (None,) * 6
    assert (ep.groups, ep.placement, ep.redundant_experts) == (1, "strict-pack", 0)
    assert "(default: 1)" in text and "(default: strict-pack)" in text and "(N = 1 when not given" in text
