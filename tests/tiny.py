"""Tiny random models built by transformers, run by turnkv (shared by the engine tests)."""

from __future__ import annotations

import torch

from turnkv.engine.engine import Engine, GenerationRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.prompt_cache.store import PromptCache

VOCAB = 256


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from turnkv.models.llama import LlamaModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    hf = LlamaForCausalLM(cfg).eval()
    return LlamaModel.from_checkpoint(cfg.to_dict(), hf.state_dict(), torch.float32), hf


def tiny_gemma3(seed: int = 0, window: int = 16):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from turnkv.models.gemma3 import Gemma3Model

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"], max_position_embeddings=4096)
    hf = Gemma3ForCausalLM(cfg).eval()
    return Gemma3Model.from_checkpoint(cfg.to_dict(), hf.state_dict(), torch.float32), hf


def prompt(n: int, seed: int = 3, vocab: int = VOCAB, low: int = 3) -> torch.Tensor:
    """``n`` random token ids in ``[low, vocab)``, the same for the same seed."""
    return torch.randint(low, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def engine(model, budget: int = 1 << 30, slack: int = 8, chunk: int = 32, **kw) -> Engine:
    return Engine(model, None, fingerprint=f"tiny-{model.family}", prompt_cache=PromptCache(budget),
                  slack=slack, prefill_chunk=chunk, max_context=4096, **kw)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def request(messages: list[list[int]], max_tokens: int, stop_ids=(), tenant: str = "") -> GenerationRequest:
    ids, bounds = [], []
    for m in messages:
        ids.extend(m)
        bounds.append(len(ids))
    return GenerationRequest(ids, greedy(max_tokens), bounds[:-1] + [len(ids)], tenant, list(stop_ids))


def random_mxfp4_experts(model, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Give a transformers gpt-oss model's experts random MXFP4 codes and power-of-two scales, as
    the released checkpoints store them: the float expert weights are set to exactly what those
    blocks hold, and the blocks / scales are returned under their checkpoint names."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for name, p in (("gate_up_proj", ex.gate_up_proj), ("down_proj", ex.down_proj)):
                E, n_in, n_out = p.shape   # [E, in, out]; blocks are [E, out, in / 32, 16]
                blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=generator, dtype=torch.uint8)
                scales = torch.randint(121, 125, (E, n_out, n_in // 32), generator=generator, dtype=torch.uint8)
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    return packed
