"""Helpers the GGUF family layouts beside this file share: reading llama.cpp's metadata the way its
loader does (float32 values, per-layer arrays, sliding-window patterns, end-of-generation ids), the
attention checks most families make, the global tensor names and the stacked-expert fuse.

Checks that refuse a file take the family's display name (``name``) for their message.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from ...errors import ModelLoadError
from ..metadata import scalar
from ..reader import GGUFArray, GGUFHeader, open_mmap

SIGMOID = 2   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.99999974e-06): what the HF config held."""
    return float(str(np.float32(value)))


# ------------------------------------------------------------------ metadata


def per_layer(h: GGUFHeader, key: str, n: int) -> list:
    """A per-layer metadata value (an array of exactly ``n``, or one number for every layer)."""
    value = h.get(key)
    if isinstance(value, GGUFArray) or (isinstance(value, list) and len(value) != n):
        raise ModelLoadError(f"{h.path}: '{key}' has {len(value)} entries for {n} layers")
    if isinstance(value, list):
        return list(value)
    if isinstance(value, (int, float)):
        return [value] * n
    raise ModelLoadError(f"{h.path}: '{key}' is not a per-layer array")


def uniform(h: GGUFHeader, key: str, n: int, default=...):
    """A key llama.cpp reads with get_key_or_arr: a scalar, or one value per layer (all equal
    over the first ``n`` layers here; later entries are MTP layers, not read)."""
    value = h.get(key, default)
    if isinstance(value, list):
        if len(value) < n:
            raise ModelLoadError(f"{h.path}: '{key}' has {len(value)} entries for {n} layers")
        values = set(value[:n])
        if len(values) != 1:
            raise ModelLoadError(f"{h.path}: per-layer values for '{key}' that differ ({value}) are not supported")
        return values.pop()
    return scalar(h, key, default)


def swa_layers(h: GGUFHeader, arch: str, n: int, period: int) -> list[bool]:
    """llama.cpp's is_swa per layer (load_swa_pattern, set_swa_pattern with dense_first=false):
    ``attention.sliding_window_pattern`` as one bool per layer, or a period (``period`` when
    absent; 0: every layer slides, else the last of each ``period`` layers is full)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = h.metadata.get(key, period)
    if isinstance(pattern, GGUFArray) or (isinstance(pattern, list) and len(pattern) < n):
        raise ModelLoadError(f"{h.path}: '{key}' has {len(pattern)} entries for {n} layers")
    if isinstance(pattern, list):
        return [bool(v) for v in pattern[:n]]
    if not isinstance(pattern, int):
        raise ModelLoadError(f"{h.path}: unreadable '{key}' {pattern!r}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]


def attention_shape(h: GGUFHeader, arch: str, name: str) -> tuple[int, int, int]:
    """(hidden size, query heads, head dim): ``attention.key_length``, else hidden / heads;
    refuses value heads of another size (llama.cpp's graphs assert them equal too)."""
    hidden = scalar(h, f"{arch}.embedding_length")
    heads = scalar(h, f"{arch}.attention.head_count")
    head_dim = scalar(h, f"{arch}.attention.key_length", hidden // heads)
    if scalar(h, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{h.path}: {name} with different key and value head sizes is not supported")
    return hidden, heads, head_dim


def check_full_rotary(h: GGUFHeader, arch: str, head_dim: int, name: str) -> None:
    """Refuses a ``rope.dimension_count`` short of the head (partial RoPE)."""
    if scalar(h, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{h.path}: {name} with a partial rotary dimension is not supported")


def rope_base(h: GGUFHeader, arch: str, default: float, name: str) -> float:
    """``rope.freq_base``; refuses a different ``rope.freq_base_swa`` (one base for every layer)."""
    rope_theta = float(scalar(h, f"{arch}.rope.freq_base", default))
    swa_theta = h.metadata.get(f"{arch}.rope.freq_base_swa")
    if swa_theta is not None and float(swa_theta) != rope_theta:
        raise ModelLoadError(f"{h.path}: {name} with its own sliding-layer rope base ({swa_theta}) is not supported")
    return rope_theta


# ---------------------------------------------------------------- token ids


def token_ids_of(h: GGUFHeader, texts) -> list[int]:
    """Ids of the vocabulary entries spelled exactly as one of ``texts`` (tokenizer.ggml.tokens is
    left unparsed by the header reader when long; this walks it in the file)."""
    tokens = h.metadata.get("tokenizer.ggml.tokens")
    wanted = {t.encode() for t in texts}
    if isinstance(tokens, list):
        return [i for i, t in enumerate(tokens) if t.encode() in wanted]
    if not isinstance(tokens, GGUFArray):
        return []
    longest = max(len(w) for w in wanted)
    buf, _ = open_mmap(h.path)
    try:
        found, pos, unpack = [], tokens.offset, struct.Struct("<Q").unpack_from
        for i in range(tokens.count):
            n = unpack(buf, pos)[0]
            if n <= longest and buf[pos + 8:pos + 8 + n] in wanted:
                found.append(i)
            pos += 8 + n
        return found
    finally:
        buf.close()


EOG_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def stop_ids(h: GGUFHeader, config: dict, texts=(), keys: tuple[str, ...] = EOG_KEYS) -> None:
    """config["eos_token_id"]: the file's eos, then the ids under ``keys`` (its eot / eom) and the
    vocabulary's ``texts`` (llama.cpp's end-of-generation set), as a list when more than one."""
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else []
    for key in keys:
        if isinstance(h.metadata.get(key), int):
            ids.append(h.metadata[key])
    if texts:
        ids += token_ids_of(h, texts)
    ids = list(dict.fromkeys(ids))
    if ids:
        config["eos_token_id"] = ids if len(ids) > 1 else ids[0]


# ------------------------------------------------------------------ tensors


def global_names(h: GGUFHeader) -> dict[str, str]:
    """The embedding, final norm and (when the file has one, i.e. untied) output head."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if "output.weight" in h.tensors:
        names["output.weight"] = "lm_head.weight"
    return names


def layer_weights(b: str, p: str, table: dict[str, str]) -> dict[str, str]:
    """``{b}.<gguf>.weight`` -> ``{p}.<transformers>.weight`` for a layer table."""
    return {f"{b}.{g}.weight": f"{p}.{t}.weight" for g, t in table.items()}


def layer_biases(b: str, p: str, table: dict[str, str], biased) -> dict[str, str]:
    """``{b}.<gguf>.bias`` -> ``{p}.<transformers>.bias`` for the ``biased`` entries of a layer table."""
    return {f"{b}.{g}.bias": f"{p}.{table[g]}.bias" for g in biased}


# stacked [E, ...] experts of a MoE block: held under these names until ``fuse_gate_up``
STACKED_EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_stack", "ffn_up_exps": "mlp.experts.up_stack",
                   "ffn_down_exps": "mlp.experts.down_proj"}


def moe_decoder_names(h: GGUFHeader, layers: int, n_dense: int, attn: dict[str, str], dense: dict[str, str],
                      moe: dict[str, str], expert_bias: str, biased=()) -> dict[str, str]:
    """Names of a decoder whose first ``n_dense`` blocks are dense and the others MoE: each block's
    ``attn`` table (``biased`` entries with a bias too), then ``dense`` or ``moe`` (router, shared
    experts), ``exp_probs_b.bias`` as ``{layer}.{expert_bias}`` and the ``STACKED_EXPERTS``."""
    names = global_names(h)
    for i in range(layers):
        b, p = f"blk.{i}", f"model.layers.{i}"
        is_dense = i < n_dense
        names |= layer_weights(b, p, attn | (dense if is_dense else moe))
        names |= layer_biases(b, p, attn, biased)
        if not is_dense:
            names[f"{b}.exp_probs_b.bias"] = f"{p}.{expert_bias}"
            names |= {f"{b}.{g}.weight": f"{p}.{t}" for g, t in STACKED_EXPERTS.items()}
    return names


def fuse_gate_up(t: dict[str, torch.Tensor], gate: str = "gate_stack", up: str = "up_stack",
                 fused: str = "gate_up_proj") -> None:
    """Every ``{p}.{gate}`` / ``{p}.{up}`` pair of stacked experts [E, I, H] fused as transformers
    holds them in memory: ``{p}.{fused}`` [E, 2I, H]. Stacks kept in GGUF blocks of one type stay
    blocks (``GGUFStack.cat_rows``); of two types they are dequantized."""
    from ....kernels import GGUFStack

    for name in [n for n in t if n.endswith(f".{gate}")]:
        p = name[: -len(gate) - 1]
        gate_w, up_w = t.pop(f"{p}.{gate}"), t.pop(f"{p}.{up}")
        if isinstance(gate_w, GGUFStack) and isinstance(up_w, GGUFStack) and gate_w.qtype == up_w.qtype:
            t[f"{p}.{fused}"] = GGUFStack.cat_rows([gate_w, up_w])
            continue
        gate_w, up_w = (w.dequantize() if isinstance(w, GGUFStack) else w for w in (gate_w, up_w))
        t[f"{p}.{fused}"] = torch.cat([gate_w, up_w], dim=1)
