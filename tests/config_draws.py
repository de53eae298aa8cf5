"""Hypothesis strategies for the config fields real checkpoints vary, and the run that checks one
drawn config: transformers builds the tiny model from its own config class and saves it (optionally
rewritten to the transformers 4 layout: ``rope_theta`` / ``rope_scaling`` instead of
``rope_parameters``), turnkv loads the folder and must either equal transformers (check_parity) or
refuse the config at load naming the field it does not implement."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ssm_family_checks import check_parity, perturb_vectors
from tiny import prompt
from turnkv.models.base import UnsupportedConfig

VOCAB = 128
# norm eps values: a large one too, so a norm given the wrong eps shows beyond the tolerance
EPS = [1e-6, 1e-5, 1e-3]
# derandomized: the same draws on every run (CI reproducible); no example database on disk
DRAWS = settings(max_examples=25, derandomize=True, deadline=None, database=None, print_blob=True,
                 suppress_health_check=list(HealthCheck))


@dataclass
class Drawn:
    """A drawn config: the config class's keyword arguments, the field turnkv must refuse (None:
    it must equal transformers), and whether to save it in the transformers 4 layout."""
    kwargs: dict
    refused: str | None = None
    old_layout: bool = False
    notes: list = field(default_factory=list)


@st.composite
def heads(draw, hidden=(32, 64)):
    """hidden size, query heads, kv heads (a divisor) and head_dim (None: hidden / heads, or one
    apart from it)."""
    h = draw(st.sampled_from(hidden))
    hq = draw(st.sampled_from([2, 4]))
    hk = draw(st.sampled_from([d for d in (1, 2, 4) if hq % d == 0]))
    head_dim = draw(st.sampled_from([None, 8, 16, 24]))
    return dict(hidden_size=h, num_attention_heads=hq, num_key_value_heads=hk, head_dim=head_dim or h // hq)


@st.composite
def common(draw, layers=(2, 3), intermediate=(32, 48, 64), hidden=(32, 64), **fixed):
    """The keyword arguments every decoder draws: vocab, depth, MLP width, tied embeddings, the
    RMSNorm eps and ``heads``; ``fixed`` overrides any of them."""
    kw = dict(vocab_size=VOCAB, num_hidden_layers=draw(st.sampled_from(layers)),
              intermediate_size=draw(st.sampled_from(intermediate)), tie_word_embeddings=draw(st.booleans()),
              rms_norm_eps=draw(st.sampled_from(EPS)), max_position_embeddings=256, initializer_range=0.1,
              **draw(heads(hidden)))
    kw.update(fixed)
    return kw


def layer_types(draw, n: int, kinds=("sliding_attention", "full_attention")) -> list[str]:
    """An explicit per-layer type list of ``n`` layers."""
    return draw(st.lists(st.sampled_from(kinds), min_size=n, max_size=n))


def refuse(draw, drawn: "Drawn", options: dict, odds: int = 6) -> None:
    """One draw in ``odds`` sets one of ``options`` (field -> value, or a function that edits the
    kwargs and returns the field turnkv must name) and marks the draw as refused."""
    if draw(st.integers(0, odds - 1)) != 0:
        return
    name = draw(st.sampled_from(sorted(options)))
    value = options[name]
    if callable(value):
        name = value(drawn.kwargs) or name
    else:
        drawn.kwargs[name] = value
    drawn.refused = name


@st.composite
def rope(draw, kinds=("default", "linear", "llama3", "yarn")):
    """rope_parameters of one of ``kinds``, scaled over a short original context so the scaling
    matters within the test prompt."""
    kind = draw(st.sampled_from(kinds))
    theta = draw(st.sampled_from([10_000.0, 500_000.0]))
    p = {"rope_type": kind, "rope_theta": theta}
    factor = draw(st.sampled_from([2.0, 4.0, 8.0]))
    if kind in ("linear", "dynamic"):
        p["factor"] = factor
    elif kind == "llama3":
        p.update(factor=factor, low_freq_factor=1.0, high_freq_factor=draw(st.sampled_from([2.0, 4.0])),
                 original_max_position_embeddings=16)
    elif kind == "yarn":
        p.update(factor=factor, original_max_position_embeddings=16,
                 beta_fast=draw(st.sampled_from([32.0, 16.0])), beta_slow=1.0)
        extra = draw(st.sampled_from(["none", "attention_factor", "mscale", "truncate"]))
        if extra == "attention_factor":
            p["attention_factor"] = draw(st.sampled_from([0.8, 1.2]))
        elif extra == "mscale":      # DeepSeek-style: the attention factor from two mscales
            p.update(mscale=draw(st.sampled_from([0.707, 1.0])), mscale_all_dim=draw(st.sampled_from([0.0, 1.0])))
        elif extra == "truncate":    # gpt-oss: the ramp's bounds not rounded
            p["truncate"] = False
    elif kind == "longrope":
        p.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=16)
    return p


# fields transformers 5 saves under another name than transformers 4 did, per model type
OLD_NAMES = {"qwen3_moe": {"num_local_experts": "num_experts"}}


def kimi_released(cfg: dict) -> None:
    """Kimi Linear's released config.json (its remote code's layout): the KDA settings and the
    1-based layer lists in ``linear_attn_config``, no layer type lists."""
    types = cfg.pop("layer_types")
    cfg["linear_attn_config"] = {
        "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim"),
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"]}


def qwen_window_layers(cfg: dict) -> None:
    """Qwen 2 / 3 before transformers wrote layer types: the window layers follow from
    max_window_layers (kept only when they are the ones it gives)."""
    n, first = cfg["num_hidden_layers"], cfg["max_window_layers"]
    if cfg.get("layer_types") == ["sliding_attention" if i >= first else "full_attention" for i in range(n)]:
        del cfg["layer_types"]


def lfm2_attention_indices(cfg: dict) -> None:
    """LFM2 as released: which layers attend only as ``full_attn_idxs``, no layer types."""
    del cfg["layer_types"]


def gemma3_pattern(cfg: dict) -> None:
    """Gemma 3 before transformers wrote layer types: every ``sliding_window_pattern``-th layer
    global (rewritten only when the layer types follow such a pattern)."""
    types, n = cfg["layer_types"], cfg["num_hidden_layers"]
    for p in range(1, n + 2):
        if types == ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]:
            del cfg["layer_types"]
            cfg["sliding_window_pattern"] = p
            return


# older layouts that are more than renames, per model type
OLD_REWRITES = {"gemma3_text": gemma3_pattern, "kimi_linear": kimi_released, "qwen2": qwen_window_layers, "qwen3": qwen_window_layers,
                "lfm2": lfm2_attention_indices}


def to_old_layout(folder: Path) -> None:
    """Rewrite a saved config.json as transformers 4 (or the family's released remote code) wrote
    it: ``rope_theta`` and ``partial_rotary_factor`` at the top, the scaling (with the old
    ``type`` key) in ``rope_scaling``, the fields of ``OLD_NAMES`` under their old names, the
    ``OLD_REWRITES`` of the model type."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for new, old in OLD_NAMES.get(cfg["model_type"], {}).items():
        cfg[old] = cfg.pop(new)
    OLD_REWRITES.get(cfg["model_type"], lambda cfg: None)(cfg)
    if "rope_parameters" not in cfg:
        path.write_text(json.dumps(cfg))
        return
    params = dict(cfg.pop("rope_parameters"))
    if "full_attention" in params:      # per layer type (Gemma 3): the local theta had its own key
        cfg["rope_local_base_freq"] = params.pop("sliding_attention")["rope_theta"]
        params = dict(params["full_attention"])
    cfg["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params:
        cfg["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    kind = params.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    path.write_text(json.dumps(cfg))


def save_load_pair(hf, old_layout: bool):
    """turnkv's model of ``hf`` through save_pretrained (and optionally the old layout) and the
    loader; raises whatever the load raises."""
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        if old_layout:
            to_old_layout(Path(tmp))
        ckpt = load_checkpoint(tmp, dtype=torch.float32, progress=False)
        return family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()


def check_drawn(make_hf, drawn: Drawn, seed: int = 0, n: int = 24, chunk: int = 5, decode: int = 6):
    """Build ``make_hf(**drawn.kwargs)`` (perturbed), load it through turnkv, then assert parity or
    the refusal naming ``drawn.refused``."""
    import torch

    torch.manual_seed(seed)
    hf = make_hf(**drawn.kwargs).eval()
    perturb_vectors(hf)
    if drawn.refused is not None:
        with pytest.raises(UnsupportedConfig, match=drawn.refused):
            save_load_pair(hf, drawn.old_layout)
        return None
    model = save_load_pair(hf, drawn.old_layout)
    return check_parity(model, hf, prompt(n, seed=seed + 1, vocab=VOCAB), chunk=chunk, decode=decode)


def check_vision(hf, save_processor, features, refused: str | None = None, size=(40, 50), seed: int = 0):
    """``hf`` (a vision-language model, perturbed) saved with the processor settings
    ``save_processor(folder)`` writes, loaded by turnkv: one picture of ``size`` prepared by
    turnkv, then its rows from turnkv's ``encode_image`` against ``features(hf, image)``
    (transformers' image features on the same pixels): as many rows as the image's tokens, within
    1e-4. With ``refused``, the load must raise UnsupportedConfig naming that field."""
    import torch
    from turnkv.loading import load_checkpoint
    from turnkv.models import family_class
    from vision_chat import picture

    perturb_vectors(hf.eval())
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        save_processor(Path(tmp))
        ckpt = load_checkpoint(tmp, dtype=torch.float32, progress=False)
        if refused is not None:
            with pytest.raises(UnsupportedConfig, match=refused):
                family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32)
            return
        model = family_class(ckpt.architecture).from_checkpoint(ckpt.config, ckpt.tensors, torch.float32).eval()
        model.load_processor(tmp)
    image = model.prepare_image(picture(seed, size))
    ours = model.encode_image(image)
    with torch.no_grad():
        ref = features(hf, image)
    assert ours.shape == ref.shape and ours.shape[0] == image.n_rows, (ours.shape, ref.shape, image.n_rows)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"image rows: max abs diff {diff:.3g} vs transformers"


__all__ = ["DRAWS", "EPS", "Drawn", "VOCAB", "check_drawn", "check_vision", "common", "heads", "layer_types", "refuse", "rope"]
