"""`turnkv perplexity`: llama-perplexity's chunking and scoring, checked against transformers' own
loss on the same chunks (a tiny random Llama with SmolLM2's tokenizer) and, where llama.cpp's
binary is at hand, against llama-perplexity on the bundled GGUFs."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from turnkv import cli
from turnkv.loading import bos_to_add, load_tokenizer
from turnkv.loading.bundled import find_bundled, locate_bundled
from turnkv.perplexity import chunk_count, evaluate
from turnkv.registry import BUNDLED

TEXT = Path(__file__).resolve().parents[1] / "turnkv" / "data" / "coriolanus.txt"
PEERS = Path(os.environ.get("TURNKV_PEERS", Path.home() / ".cache" / "turnkv-peers"))
LLAMA_PERPLEXITY = PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-perplexity"
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def _require(name: str) -> Path:
    if not find_bundled(name)[0]:
        pytest.skip(f"{BUNDLED[name].package} not installed ({BUNDLED[name].install})")
    return locate_bundled(name)


def _run_cli(capsys, *args: str) -> tuple[list[float], float, float]:
    assert cli.main(["perplexity", "-q", *args]) == 0
    out = capsys.readouterr().out
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", out)]
    ppl, err = FINAL.search(out).groups()
    return running, float(ppl), float(err)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random 2-layer Llama saved by transformers beside SmolLM2's (converted) tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _require("smollm2-135m")
    source = load_tokenizer("smollm2-135m").source
    folder = tmp_path_factory.mktemp("tiny-ppl")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                                      eos_token_id=2, max_position_embeddings=1024)).eval()
    hf.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, folder / file)
    return folder, hf


def transformers_reference(hf, tokens: list[int], n_ctx: int, n_chunks: int, bos: int | None):
    """Per chunk, transformers' own loss over the second half (labels -100 elsewhere), and every
    scored token's NLL, each chunk run alone with its first token replaced by ``bos``."""
    losses, nlls = [], []
    for i in range(n_chunks):
        ids = torch.tensor([tokens[i * n_ctx:(i + 1) * n_ctx]])
        if bos is not None:
            ids[0, 0] = bos
        labels = ids.clone()
        labels[0, :n_ctx // 2 + 1] = -100      # HF shifts: label j is predicted at position j - 1
        with torch.inference_mode():
            out = hf(ids, labels=labels)
        losses.append(out.loss.item())
        logits = out.logits[0, n_ctx // 2:n_ctx - 1].double()
        nlls.append(torch.nn.functional.cross_entropy(logits, ids[0, n_ctx // 2 + 1:], reduction="none"))
    return losses, torch.cat(nlls)


def test_cli_on_an_hf_folder_equals_transformers_loss_on_the_same_chunks(capsys, tiny_folder):
    folder, hf = tiny_folder
    tok = load_tokenizer(folder)
    assert bos_to_add(folder, tok) is None          # SmolLM2's tokenizer starts no text with BOS
    tokens = tok.encode(TEXT.read_text(), add_special_tokens=False)
    running, ppl, err = _run_cli(capsys, "-m", str(folder), "-f", str(TEXT), "-c", "64", "--chunks", "3", "-b", "24")
    losses, nlls = transformers_reference(hf, tokens, 64, 3, None)
    assert len(running) == 3 and len(nlls) == 3 * 31
    for k, got in enumerate(running):       # the running estimate: exp(mean loss of chunks 1..k)
        assert got == pytest.approx(math.exp(sum(losses[:k + 1]) / (k + 1)), rel=2e-4)
    assert ppl == pytest.approx(math.exp(nlls.mean().item()), rel=2e-4)
    assert err == pytest.approx(math.sqrt(nlls.var(unbiased=False).item() / (len(nlls) - 1)) * ppl, rel=2e-3)


def test_bos_replaces_each_chunks_first_token_and_batching_changes_nothing(tiny_folder):
    from turnkv.loading.model import load_model

    folder, hf = tiny_folder
    loaded = load_model(str(folder), progress=False)
    tokens = [1] + loaded.tokenizer.encode(TEXT.read_text()[:4000], add_special_tokens=False)
    whole = evaluate(loaded.net, tokens, 48, bos=1, chunks=4, batch=48)
    pieces = evaluate(loaded.net, tokens, 48, bos=1, chunks=4, batch=5)
    assert pieces.running == pytest.approx(whole.running, rel=1e-5)
    losses, _ = transformers_reference(hf, tokens, 48, 4, bos=1)
    assert whole.ppl == pytest.approx(math.exp(sum(losses) / 4), rel=2e-4)
    no_bos = evaluate(loaded.net, tokens, 48, bos=None, chunks=4)      # the chunks' own first tokens
    assert no_bos.ppl == pytest.approx(math.exp(sum(transformers_reference(hf, tokens, 48, 4, None)[0]) / 4),
                                       rel=2e-4)
    assert no_bos.ppl != pytest.approx(whole.ppl, rel=1e-4)


def test_chunk_count_follows_llama_perplexity():
    assert chunk_count(1000, 128) == 7 and chunk_count(1000, 128, 3) == 3 and chunk_count(256, 128) == 2
    with pytest.raises(ValueError, match="at least 256 tokens with a context of 128; the text tokenizes to only 255"):
        chunk_count(255, 128)


def test_a_text_too_short_is_a_clean_error(tmp_path, capsys, tiny_folder):
    short = tmp_path / "short.txt"
    short.write_text("Before we proceed any further, hear me speak.")
    assert cli.main(["perplexity", "-q", "-m", str(tiny_folder[0]), "-f", str(short), "-c", "64"]) == 2
    assert "perplexity needs at least 128 tokens" in capsys.readouterr().err


def _llama_perplexity(model: Path, n_ctx: int, chunks: int) -> tuple[float, float]:
    proc = subprocess.run([str(LLAMA_PERPLEXITY), "-m", str(model), "-f", str(TEXT), "-c", str(n_ctx),
                           "-b", str(n_ctx), "--chunks", str(chunks), "-t", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ppl, err = FINAL.search(proc.stdout + proc.stderr).groups()
    return float(ppl), float(err)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_within_one_percent_of_llama_perplexity(capsys, name):
    """SmolLM2 adds no BOS, Gemma 3 does: both of llama-perplexity's ways of starting a chunk."""
    path = _require(name)
    if not LLAMA_PERPLEXITY.is_file():
        pytest.skip(f"llama.cpp's llama-perplexity is not built at {LLAMA_PERPLEXITY}")
    expected, expected_err = _llama_perplexity(path, 128, 4)
    _, ppl, err = _run_cli(capsys, "-m", name, "-f", str(TEXT), "-c", "128", "--chunks", "4")
    assert ppl == pytest.approx(expected, rel=0.01)
    assert err == pytest.approx(expected_err, rel=0.03)
