"""The command line as a user runs it: real bundled model, real process, no traceback on bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real


def turnkv(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turnkv.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("turnkv: error:"), err
    for needle in needles:
        assert needle in err, err


def test_generate_answers_paris():
    # the float32 reference: under the default (gguf when the native kernels are built) SmolLM2's
    # first token here is a near-tie ("The" 25.33, "L" 25.24 in float32) that the int8
    # activations flip ("L'Étoile, la Cité, ..."); tests/test_gguf_weights.py holds gguf to native
    proc = turnkv("generate", "-m", "smollm2-135m", "-p", "What is the capital of France?",
                  "--max-tokens", "16", "--temperature", "0", "--weights", "native")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "TTFT" in proc.stderr


def test_generate_in_a_packed_weight_format_answers_paris():
    # int4 on SmolLM2's Q4 projections holds the GGUF's own 4-bit blocks; the banner names the format
    proc = turnkv("generate", "-m", "smollm2-135m", "-p", "What is the capital of France?",
                  "--max-tokens", "16", "--temperature", "0", "--weights", "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_weight_format_a_family_cannot_hold(tmp_path):
    # a tiny Mamba2 folder saved by transformers: the family declares no packable weights
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                          num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=8)
    folder = tmp_path / "mamba2"
    Mamba2ForCausalLM(config).save_pretrained(folder)
    assert_clean_error(turnkv("generate", "-m", str(folder), "-p", "hi", "--weights", "int8"), "int8", "native")


def test_models_lists_both_bundled():
    proc = turnkv("models")
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m" in proc.stdout and "gemma3-270m" in proc.stdout
    # an installed model's GGUF types, each with the kernel that runs it
    lines = proc.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.split()[1:2] == ["yes"]:
            nxt = lines[i + 1]
            assert nxt.split()[:2] == ["GGUF", "types:"] and (": native" in nxt or ": reference" in nxt), proc.stdout


def test_chat_keeps_history_and_reuses_state():
    proc = turnkv("chat", "-m", "smollm2-135m", "--max-tokens", "12",
                  stdin="Name a fruit that is yellow.\nAnd one that is red?\n/exit\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[prompt")]
    assert len(stats) == 2, proc.stderr
    cached_turn2 = int(stats[1].split("cached ")[1].split(",")[0])
    assert cached_turn2 > 0, stats


def test_missing_model_file(tmp_path):
    assert_clean_error(turnkv("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"), "nope.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(os.urandom(4096))
    assert_clean_error(turnkv("generate", "-m", str(bad), "-p", "hi"), "broken.gguf")


def test_unknown_bundled_name():
    assert_clean_error(turnkv("generate", "-m", "no-such-model", "-p", "hi"), "no-such-model")


def test_prompt_longer_than_context():
    assert_clean_error(turnkv("generate", "-m", "smollm2-135m", "--max-context", "16", "-p", "word " * 50),
                       "context")


def test_bad_sampling_value():
    assert_clean_error(turnkv("generate", "-m", "smollm2-135m", "-p", "hi", "--top-p", "0"), "top_p")


def test_negative_tier_keep_turns_is_refused_before_loading():
    proc = turnkv("generate", "-m", "smollm2-135m", "--cache-dir", "/nonexistent", "--tier-keep-turns", "-1",
                  "-p", "hi", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--tier-keep-turns: expected an integer >= 0, got -1" in proc.stderr.strip().splitlines()[-1]
    assert "Loading" not in proc.stderr                      # refused by argparse, no model read


def test_help_defaults_match_the_engine():
    """cli.py repeats a few defaults so `--help` need not import torch; they must stay equal."""
    from turnkv import cli
    from turnkv.engine import scheduler
    from turnkv.models.weights import FORMATS

    assert (cli.DEFAULT_MAX_SEQS, cli.DEFAULT_MAX_BATCH_TOKENS, cli.DEFAULT_MAX_QUEUE) == (
        scheduler.DEFAULT_MAX_SEQS, scheduler.DEFAULT_MAX_BATCH_TOKENS, scheduler.DEFAULT_MAX_QUEUE)
    assert set(cli.WEIGHT_FORMATS) == set(FORMATS)
    from turnkv.engine import drafters, speculative
    assert (cli.SPECULATIVE_MODES, cli.DEFAULT_DRAFT_MAX) == (drafters.MODES, speculative.DEFAULT_DRAFT_MAX)
    assert cli.build_parser().parse_args(["serve"]).speculative == drafters.AUTO     # the default (docs/speculative.md)
    from turnkv import images
    assert (cli.DEFAULT_MAX_IMAGE_PIXELS, cli.DEFAULT_IMAGE_CACHE_MB) == (images.DEFAULT_MAX_IMAGE_PIXELS,
                                                                         images.DEFAULT_IMAGE_CACHE_MB)
    from turnkv.prompt_cache import tier as tiers
    assert cli.build_parser().parse_args(["generate", "-p", "hi"]).tier_keep_turns == tiers.DEFAULT_KEEP_TURNS
    from turnkv import perplexity
    assert (cli.PPL_CTX, cli.PPL_BATCH) == (perplexity.DEFAULT_CTX, perplexity.DEFAULT_BATCH)
    from turnkv.server import context as app
    assert (cli.DEFAULT_MAX_MESSAGES, cli.DEFAULT_MAX_CONNECTIONS) == (app.DEFAULT_MAX_MESSAGES,
                                                                       app.DEFAULT_MAX_CONNECTIONS)


def test_no_import_circles_between_cli_server_and_launch():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "turnkv"

    def imports(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.lstrip("."))
        return names

    assert not any(m.endswith("cli") for m in imports(root / "server" / "app.py"))
    assert not any(m.endswith("cli") or m.startswith("server") for m in imports(root / "launch.py"))
    assert not any("bundled" in m for m in imports(root / "registry.py"))
    assert not any(m.endswith("specs") for m in imports(root / "cache" / "storage.py"))
