"""RWKV-7 from llama.cpp's ``rwkv7`` GGUF layout (conversion/rwkv.py ``Rwkv7Model``, which converts
fla-hub's ``RWKV7ForCausalLM`` folders): back to fla-hub's names, which models/rwkv7.py reads.

The converter stacks the six time-mix interpolations ``x_r, x_w, x_k, x_v, x_a, x_g`` into
``time_mix_lerp_fused`` [6, 1, 1, hidden] (split again here), flattens ``r_k`` (the model reshapes
it), writes the LoRA down / up / bias of the decay, in-context rate, value-residual and gate
projections as ``time_mix_{w,a,v,g}{1,2,0}`` and layer 0's ``pre_norm`` as ``token_embd_norm``;
layer 0's ``time_mix_v*`` are dummies (copies of ``a``) that the model never reads. The world
tokenizer (``tokenizer.ggml.model`` "rwkv", a trie over RWKV's vocabulary) is loaded by
loading/rwkv_tokenizer.py; a file with a GPT-2 style vocabulary loads as any other.
"""

from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..architecture import GGUFArchitecture
from ..metadata import scalar, token_ids, vocab_size
from ..reader import GGUFHeader
from .common import f32

ARCH = "rwkv7"
_MIXES = "rwkvag"     # the converter's stacking order (wkv_has_gate)
_LAYER = {"attn_norm": "attn_norm", "attn_norm_2": "ffn_norm", "time_mix_receptance": "attn.r_proj",
          "time_mix_key": "attn.k_proj", "time_mix_value": "attn.v_proj", "time_mix_output": "attn.o_proj",
          "time_mix_ln": "attn.g_norm", "channel_mix_key": "ffn.key", "channel_mix_value": "ffn.value"}
_VECTORS = {"time_mix_k_k": "attn.k_k", "time_mix_k_a": "attn.k_a", "time_mix_r_k": "attn.r_k",
            "channel_mix_lerp_k": "ffn.x_k", "time_mix_lerp_fused": "attn.x_fused"}


def _lora(kind: str, bias: bool) -> dict[str, str]:
    names = {f"time_mix_{kind}1.weight": f"attn.{kind}_lora.lora.0.weight",
             f"time_mix_{kind}2.weight": f"attn.{kind}_lora.lora.2.weight"}
    if bias:
        names[f"time_mix_{kind}0.weight"] = f"attn.{kind}_lora.lora.2.bias"
    return names


def _config(h: GGUFHeader) -> dict:
    hidden, head = scalar(h, f"{ARCH}.embedding_length"), scalar(h, f"{ARCH}.wkv.head_size")
    if hidden % head:
        raise ModelLoadError(f"{h.path}: embedding length {hidden} is not a multiple of the WKV head size {head}")
    return {
        "model_type": "rwkv7",
        "architectures": ["RWKV7ForCausalLM"],
        "vocab_size": vocab_size(h, ARCH),
        "hidden_size": hidden,
        "num_hidden_layers": scalar(h, f"{ARCH}.block_count"),
        "head_dim": head,
        "intermediate_size": scalar(h, f"{ARCH}.feed_forward_length"),
        "norm_eps": f32(scalar(h, f"{ARCH}.attention.layer_norm_epsilon", 1e-5)),
        "norm_bias": "output_norm.bias" in h.tensors,
        "tie_word_embeddings": "output.weight" not in h.tensors,
        **token_ids(h),
    }


def _tensor_names(h: GGUFHeader, config: dict) -> dict[str, str]:
    names = {"token_embd.weight": "model.embeddings.weight", "output_norm.weight": "model.norm.weight",
             "token_embd_norm.weight": "model.layers.0.pre_norm.weight"}
    if config["norm_bias"]:
        names |= {"output_norm.bias": "model.norm.bias", "token_embd_norm.bias": "model.layers.0.pre_norm.bias"}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for i in range(config["num_hidden_layers"]):
        table = {f"{g}.weight": f"{t}.weight" for g, t in (_LAYER | _VECTORS).items()}
        table |= {f"{g}.bias": f"{t}.bias" for g, t in _LAYER.items() if f"blk.{i}.{g}.bias" in h.tensors}
        for kind, bias in (("w", True), ("a", True), ("g", False)) + ((("v", True),) if i else ()):
            table |= _lora(kind, bias)
        names |= {f"blk.{i}.{g}": f"model.layers.{i}.{t}" for g, t in table.items()}
    return names


def _finish(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    for i in range(config["num_hidden_layers"]):
        fused = t.pop(f"model.layers.{i}.attn.x_fused.weight").reshape(len(_MIXES), -1)
        for n, row in zip(_MIXES, fused):
            t[f"model.layers.{i}.attn.x_{n}"] = row
        for g, name in _VECTORS.items():
            if g != "time_mix_lerp_fused":
                t[f"model.layers.{i}.{name}"] = t.pop(f"model.layers.{i}.{name}.weight")
    return t


ARCHITECTURES = {ARCH: GGUFArchitecture(model_type="rwkv7", build_config=_config, layer_tensors={},
                                        tensor_names=_tensor_names, finish=_finish)}
