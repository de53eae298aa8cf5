"""The tiny random transformers models the GGUF fixtures are converted from (convert.py).

`make_<family>()` returns (model, vocab_patches): vocab_patches names converter classes whose
set_vocab must be pointed at the GPT-2 writer (see convert.py). Models are small (a few hundred
kB) and their 1-D weights perturbed, so a wrong norm offset or a missing bias shows."""

from __future__ import annotations

import torch

VOCAB = 320


def perturb(model, seed: int = 1, scale: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def make_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    return perturb(LlamaForCausalLM(cfg)), ()
