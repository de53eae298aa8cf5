"""Random-weight GGUFs of real model shapes, made the way a user's file is made.

A transformers model of a released checkpoint's shapes (default initialisation: std 0.02 weights,
norms at 1, so activations stay in a realistic range) is saved with save_pretrained beside the
bundled SmolLM2 tokenizer (vocabulary 49152), converted by llama.cpp's own convert_hf_to_gguf.py to
BF16 and quantized by llama-quantize to each asked type. IQ2 / IQ3 types get an importance matrix
from llama-imatrix on turnkv/data's text first. Everything lives in a cache folder outside the
repository (default ~/.cache/turnkv-realsize/<preset>/); a step whose output exists is skipped.

The vocabulary is SmolLM2's, not the released model's, so embedding and output tables are smaller
than the real ones (Llama 3.2's 128256 rows become 49152); every layer's shapes are the real ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("TURNKV_PEERS", Path.home() / ".cache" / "turnkv-peers"))
LLAMA_CPP = PEERS / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
CACHE = Path(os.environ.get("TURNKV_REALSIZE_CACHE", Path.home() / ".cache" / "turnkv-realsize"))
VOCAB = 49152
DEFAULT_TYPES = ("Q4_K_M", "Q8_0", "IQ4_XS")
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS")


def _llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **kw)


def _qwen3(**kw):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=VOCAB, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True, **kw)


def _gemma3(**kw):
    from transformers import Gemma3TextConfig
    layers = 26
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=1152, intermediate_size=6912, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                            layer_types=types, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                            query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6, **kw)


def _lfm2(**kw):
    from transformers import Lfm2Config
    full = {2, 5, 8, 10, 12, 14}
    return Lfm2Config(vocab_size=VOCAB, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, norm_eps=1e-5, rope_theta=1000000.0,
                      block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
                      layer_types=["full_attention" if i in full else "conv" for i in range(16)],
                      conv_L_cache=3, max_position_embeddings=128000, tie_word_embeddings=True, **kw)


def _qwen3_moe(**kw):
    # Qwen3-30B-A3B's attention and experts (128 of width 768, 8 per token), 6 of its 48 layers
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0,
                          max_position_embeddings=40960, tie_word_embeddings=False, **kw)


# preset -> (config builder, converter classes whose set_vocab must use the GPT-2 writer)
PRESETS = {
    "llama-3.2-1b": (_llama, ()),
    "qwen3-4b": (_qwen3, ()),
    "gemma-3-1b": (_gemma3, ()),
    "lfm2-1.2b": (_lfm2, ()),
    "qwen3-30b-a3b-6l": (_qwen3_moe, ()),
}


def _step(what: str, out: Path, run) -> Path:
    """Run ``run()`` unless ``out`` exists; say what and how long (these steps take minutes)."""
    if out.exists():
        print(f"  {out.name}: exists, skipped", flush=True)
        return out
    print(f"  {what} -> {out.name} ...", flush=True)
    t0 = time.perf_counter()
    run()
    size = sum(f.stat().st_size for f in out.rglob("*")) if out.is_dir() else out.stat().st_size
    print(f"  {out.name}: {size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _save_hf(preset: str, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnkv.loading.bundled import locate_bundled

    build, _ = PRESETS[preset]
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".part")
    model = AutoModelForCausalLM.from_config(build(bos_token_id=1, eos_token_id=2, pad_token_id=2),
                                             dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    smol = locate_bundled("smollm2-135m")
    AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name).save_pretrained(tmp)
    os.replace(tmp, folder)


def _convert(preset: str, hf: Path, out: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "gguf_fixtures"))
    from convert import convert
    # the SmolLM2 tokenizer: its pre-tokenizer is the one the converter calls "smollm"
    convert(LLAMA_CPP, hf, out, "bf16", PRESETS[preset][1], pre="smollm")


def _imatrix(f16: Path, out: Path) -> None:
    text = ROOT / "turnkv" / "data" / "coriolanus.txt"
    _quiet([str(LLAMA_CPP / "build" / "bin" / "llama-imatrix"), "-m", str(f16), "-f", str(text),
            "-o", str(out), "-c", "512", "--chunks", "16", "-t", str(os.cpu_count() or 2)])


def _quiet(cmd: list[str]) -> None:
    """Run a llama.cpp tool; its per-tensor log is shown only when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"{Path(cmd[0]).name} failed (exit status {r.returncode})")


def make(preset: str, types=DEFAULT_TYPES, cache: Path = CACHE) -> dict[str, Path]:
    """The preset's GGUF of each type (BF16 too), made where missing; type -> path."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    folder = cache / preset
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{preset}: {folder}", flush=True)
    hf = _step("random weights (transformers, bf16)", folder / "hf", lambda: _save_hf(preset, folder / "hf"))
    bf16 = _step("convert_hf_to_gguf.py", folder / f"{preset}-BF16.gguf",
                 lambda: _convert(preset, hf, folder / f"{preset}-BF16.gguf"))
    files = {"BF16": bf16}
    imatrix = folder / "imatrix.dat"
    quantize = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    for qtype in types:
        qtype = qtype.upper()
        if qtype == "BF16":
            continue
        args = []
        if qtype in NEEDS_IMATRIX:
            _step("llama-imatrix on turnkv/data text", imatrix, lambda: _imatrix(bf16, imatrix))
            args = ["--imatrix", str(imatrix)]
        out = folder / f"{preset}-{qtype}.gguf"
        for tool in [quantize] + ([LLAMA_CPP / "build" / "bin" / "llama-imatrix"] if args else []):
            if not out.exists() and not tool.exists():
                raise SystemExit(f"{tool} is missing: build it with `cmake --build build --target {tool.name}` in "
                                 f"{LLAMA_CPP} (../shared/peers/build-llama-server.sh makes that folder)")

        def run(out=out, qtype=qtype, args=args):
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                part = Path(tmp) / out.name
                _quiet([str(quantize), *args, str(bf16), str(part), qtype, str(os.cpu_count() or 2)])
                os.replace(part, out)

        files[qtype] = _step(f"llama-quantize {qtype}", out, run)
    return files
