"""Checks shared by the recurrent-family tests (mamba2, qwen3_next, recurrent_gemma): a tiny random
transformers model saved with save_pretrained, loaded back through turnkv's own loader, compared
with transformers logit for logit, and snapshot/restore exactness at model level."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turnkv.cache.base import DIVERGED_UNTRIMMABLE, SnapshotMismatch
from turnkv.cache.specs import RECURRENT, make_caches
from turnkv.loading import load_checkpoint
from turnkv.models import family_class

PARITY_TOL = 1e-4
REUSE_TOL = 1e-5


def perturb_vectors(model: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    """Random init leaves norms at 0/1 and biases at 0, which would hide a wrong (1 + w) or a
    missing bias; nudge every 1-D parameter so they all matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))


def nudge_score_biases(model: torch.nn.Module, seed: int = 3, scale: float = 0.2) -> None:
    """DeepSeek-V3-style routers keep a score-correction bias as a buffer at 0, which perturb_vectors
    does not reach: give it values so the routing depends on it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(scale * torch.randn(buf.shape, generator=g))


def saved_pair(tmp_path: Path, seed: int, make):
    """``make()``'s transformers model built after torch.manual_seed(seed), and turnkv's model of it
    through save_pretrained and turnkv's loader: (turnkv model, transformers model)."""
    torch.manual_seed(seed)
    hf = make()
    return save_and_load(hf, tmp_path), hf


def save_and_load(hf_model, tmp_path: Path):
    """save_pretrained (safetensors) -> turnkv's loader -> our family's model."""
    hf_model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
    return model.eval()


def fresh(model):
    return make_caches(model.cache_specs())


def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(tokens[None], use_cache=False).logits[0].float()


def run_chunks(model, caches, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    outs = []
    with torch.no_grad():
        for s in range(0, tokens.shape[0], chunk):
            outs.append(model.step(tokens[s:s + chunk], caches, logits="all"))
    return torch.cat(outs)


def check_parity(model, hf_model, tokens: torch.Tensor, chunk: int = 7, decode: int = 10) -> dict[str, float]:
    """Max |ours - transformers| for a one-chunk prefill, a many-chunk prefill and token-by-token
    decode of the last ``decode`` tokens; asserts each is within PARITY_TOL."""
    ref = hf_logits(hf_model, tokens)
    T = tokens.shape[0]
    diffs = {}
    diffs["one_chunk"] = (run_chunks(model, fresh(model), tokens, T) - ref).abs().max().item()
    diffs["many_chunks"] = (run_chunks(model, fresh(model), tokens, chunk) - ref).abs().max().item()
    caches = fresh(model)
    with torch.no_grad():
        model.step(tokens[: T - decode], caches, logits="none")
        steps = torch.stack([model.step(tokens[t:t + 1], caches, logits="last") for t in range(T - decode, T)])
    diffs["decode"] = (steps - ref[T - decode:]).abs().max().item()
    with torch.no_grad():
        last = model.step(tokens, fresh(model), logits="last")
    diffs["last"] = (last - ref[-1]).abs().max().item()
    for name, d in diffs.items():
        assert d < PARITY_TOL, f"{name}: max abs diff {d:.3g} vs transformers"
    return diffs


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    caches = fresh(model)
    out = []
    with torch.no_grad():
        logits = model.step(prompt, caches, logits="last")
        for _ in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            logits = model.step(torch.tensor([tok]), caches, logits="last")
    return out


def hf_greedy(hf_model, prompt: torch.Tensor, n: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        seq = hf_model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    return seq[0, prompt.shape[0]:].tolist()


def check_reuse(model, tokens: torch.Tensor, L: int, chunk: int = 5) -> float:
    """Feed L tokens, snapshot every layer, keep going; restoring the snapshots into fresh caches and
    feeding the same continuation must give the cold run's logits. A recurrent snapshot refuses any
    other length with diverged_untrimmable."""
    caches = fresh(model)
    run_chunks(model, caches, tokens[:L], chunk)
    snaps = [c.snapshot() for c in caches]
    cold = run_chunks(model, caches, tokens[L:], chunk)
    warm_caches = restored(model, snaps)
    assert all(c.offset == L for c in warm_caches)
    warm = run_chunks(model, warm_caches, tokens[L:], chunk)
    diff = (warm - cold).abs().max().item()
    assert diff <= REUSE_TOL, f"restored run differs from the cold run by {diff:.3g}"
    # a decode-shaped continuation from the same snapshots agrees with a chunked one
    steps = run_chunks(model, restored(model, snaps), tokens[L:L + 4], 1)
    chunk4 = run_chunks(model, restored(model, snaps), tokens[L:L + 4], 4)
    assert (steps - chunk4).abs().max().item() < PARITY_TOL

    recurrent = [i for i, s in enumerate(model.cache_specs()) if s.kind == RECURRENT]
    assert recurrent, "family has no recurrent layer"
    probe = fresh(model)
    for i in recurrent:
        for bad in (L - 1, 0, L // 2):
            with pytest.raises(SnapshotMismatch) as err:
                probe[i].restore(snaps[i], bad)
            assert err.value.reason == DIVERGED_UNTRIMMABLE
            assert not snaps[i].can_restore_to(bad)
            assert probe[i].offset == 0  # a refused restore leaves the live cache untouched
    return diff


def restored(model, snaps):
    caches = fresh(model)
    for c, s in zip(caches, snaps):
        c.restore(s)
    return caches


def check_restore_at_its_length(model, tokens: torch.Tensor, length: int) -> None:
    """Layer 0 is a recurrent state, layer 1 attention: a snapshot after ``length`` tokens restores
    to ``length`` (== a cold prefill of it, continued); layer 0 refuses ``length - 1`` as
    diverged_untrimmable and ``length + 1`` as out of range, where layer 1 alone could go back."""
    caches = fresh(model)
    run_chunks(model, caches, tokens[:length], 16)
    snaps = [c.snapshot() for c in caches]
    warm = fresh(model)
    for c, s in zip(warm, snaps):
        c.restore(s, length)
    cold = fresh(model)
    run_chunks(model, cold, tokens[:length], length)
    a, b = run_chunks(model, warm, tokens[length:], 3), run_chunks(model, cold, tokens[length:], 3)
    assert (a - b).abs().max().item() <= REUSE_TOL
    assert snaps[1].can_restore_to(length - 1) and not snaps[0].can_restore_to(length - 1)
    probe = fresh(model)
    with pytest.raises(SnapshotMismatch) as err:
        probe[0].restore(snaps[0], length - 1)
    assert err.value.reason == DIVERGED_UNTRIMMABLE
    with pytest.raises(SnapshotMismatch):
        probe[0].restore(snaps[0], length + 1)
    assert all(c.offset == 0 for c in probe)
