"""RWKV-7 against rwkv7-hf's RWKV7ForCausalLM (the readable pure-PyTorch port, in fla-hub's layout:
the folder llama.cpp's converter reads) on a tiny random checkpoint its own classes write.
The contract every family keeps (parity, greedy, restore rule): tests/test_family_contract.py;
here, what is this family's own."""

import torch

from ssm_family_checks import check_parity, run_chunks, fresh, save_and_load
from tiny import prompt
from turnkv.cache.specs import RECURRENT

HIDDEN, LAYERS, HEAD_DIM = 64, 3, 16


def build(vocab_size: int = 256, **sizes):
    """A tiny RWKV7ForCausalLM (``sizes``: config fields to change). Its init leaves the token-shift
    mixes, ``r_k`` and the norms at 0 / 1, which would hide a wrong shift or bonus term: every tensor
    that is not a matrix gets values."""
    from rwkv7_hf import RWKV7Config, RWKV7ForCausalLM

    fields = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, head_dim=HEAD_DIM, decay_low_rank_dim=16,
                  gate_low_rank_dim=32, a_low_rank_dim=16, v_low_rank_dim=8, intermediate_size=160)
    config = RWKV7Config(vocab_size=vocab_size, initializer_range=0.1, **{**fields, **sizes})
    hf = RWKV7ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".x_" in name:
                p.copy_(torch.rand(p.shape, generator=g))
            elif p.ndim == 1 or name.endswith("r_k"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return hf


def tiny(tmp_path):
    torch.manual_seed(0)
    hf = build()
    return save_and_load(hf, tmp_path), hf


def hf_greedy(hf, p: torch.Tensor, n: int) -> list[int]:
    """The reference's greedy tokens through its own recurrent cache (its generate() re-runs the
    whole sequence every step under transformers 5: same tokens, 30x slower)."""
    out, toks = [], []
    with torch.no_grad():
        out = hf(p[None], use_cache=True)
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


def test_cache_specs_are_the_wkv_and_two_shift_states(pair):
    model, _ = pair
    specs = model.cache_specs()
    assert len(specs) == LAYERS and all(s.kind == RECURRENT and s.state_dtype == "float32" for s in specs)
    assert dict(specs[0].fields) == {"wkv": (HIDDEN // HEAD_DIM, HEAD_DIM, HEAD_DIM), "att_shift": (HIDDEN,),
                                     "ffn_shift": (HIDDEN,)}


def test_token_by_token_from_the_first_token(pair):
    # every token through a one-row step, starting from empty state: the shift states carry it
    model, hf = pair
    check_parity(model, hf, prompt(12, seed=13), chunk=1, decode=11)


def test_chunked_prefill_equals_token_by_token(pair):
    # the recurrence runs token by token inside a chunk too, so only the row-wise projections'
    # rounding at another row count may differ
    model, _ = pair
    p = prompt(50, seed=4)
    with torch.no_grad():
        chunks = [run_chunks(model, fresh(model), p, c) for c in (50, 9, 1)]
    assert (chunks[0] - chunks[2]).abs().max().item() < 1e-5
    assert (chunks[1] - chunks[2]).abs().max().item() < 1e-5


def test_reference_cache_greedy_is_the_full_rerun(pair):
    # the cached reference loop above is the same model as a full forward of the grown sequence
    _, hf = pair
    p = prompt(20, seed=9)
    toks = hf_greedy(hf, p, 4)
    with torch.no_grad():
        full = hf(torch.cat([p, torch.tensor(toks[:-1])])[None]).logits[0, -1]
    assert int(full.argmax()) == toks[-1]
