"""A GLM-4-MoE GGUF with Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top 8, a
shared expert; 32 query / 4 KV heads of 128) and a few layers, in Q4_K_M's types (Q4_K, the
experts' down projection Q6_K), written as random valid blocks with scales that keep weights near
std 0.02. The tokenizer is the GLM-4-MoE test fixture's (320 tokens), so the head is small and a
decode step is the layers' cost. For measuring memory and speed at real expert sizes, not quality.

    python bench/moe_gguf.py OUT.gguf [--layers 3] [--dense 1]
    python bench/moe_gguf.py --measure FILE.gguf      # resident memory after load, decode tok/s
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "gguf_fixtures" / "glm4_moe" / "glm4_moe-q8_0.gguf"
H, E, USED, I_EXP, I_DENSE, HQ, HK, D = 2048, 128, 8, 768, 6144, 32, 4, 128
ARCH = "glm4moe"


def q4_k(rows: int, k: int, rng) -> np.ndarray:
    """d * sc * q - dmin * m with q 0..15, 6-bit sc / m: d, dmin small so |w| stays ~0.02, about centred."""
    b = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    dm = np.stack([np.full(b.shape[:2], 8e-5, np.float16), np.full(b.shape[:2], 6e-4, np.float16)], -1)
    b[..., :4] = dm.view(np.uint8).reshape(*b.shape[:2], 4)
    return b.reshape(rows, -1)


def q6_k(rows: int, k: int, rng) -> np.ndarray:
    """d * scale * (q - 32), q 0..63, int8 scales: d small."""
    b = rng.integers(0, 256, (rows, k // 256, 210), dtype=np.uint8)
    b[..., 192:208] = rng.integers(-16, 16, (*b.shape[:2], 16)).astype(np.int8).view(np.uint8)
    b[..., 208:210] = np.full(b.shape[:2], 6e-5, np.float16).view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


def add(w: GGUFWriter, name: str, shape: tuple[int, ...], qtype: Q, rng) -> None:
    """``shape`` in numpy order ([E,] out, in)."""
    if qtype == Q.F32:
        data = np.ones(shape, np.float32) if name.endswith("norm.weight") else \
            (rng.standard_normal(shape, dtype=np.float32) * 0.02 if name.endswith("inp.weight") else np.zeros(shape, np.float32))
        w.add_tensor(name, data)
        return
    rows = int(np.prod(shape[:-1]))
    raw = (q4_k if qtype == Q.Q4_K else q6_k)(rows, shape[-1], rng)
    w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=qtype)


def tensors(layers: int, dense: int, vocab: int):
    yield "token_embd.weight", (vocab, H), Q.Q4_K
    yield "output_norm.weight", (H,), Q.F32
    yield "output.weight", (vocab, H), Q.Q6_K
    for i in range(layers):
        b = f"blk.{i}"
        yield from ((f"{b}.{n}.weight", (H,), Q.F32) for n in ("attn_norm", "post_attention_norm"))
        yield f"{b}.attn_q.weight", (HQ * D, H), Q.Q4_K
        yield f"{b}.attn_k.weight", (HK * D, H), Q.Q4_K
        yield f"{b}.attn_v.weight", (HK * D, H), Q.Q6_K
        yield f"{b}.attn_output.weight", (H, HQ * D), Q.Q4_K
        yield from ((f"{b}.attn_{x}.bias", (n * D,), Q.F32) for x, n in (("q", HQ), ("k", HK), ("v", HK)))
        if i < dense:
            yield from ((f"{b}.ffn_{n}.weight", (I_DENSE, H), Q.Q4_K) for n in ("gate", "up"))
            yield f"{b}.ffn_down.weight", (H, I_DENSE), Q.Q6_K
            continue
        yield f"{b}.ffn_gate_inp.weight", (E, H), Q.F32
        yield f"{b}.exp_probs_b.bias", (E,), Q.F32
        yield from ((f"{b}.ffn_{n}_exps.weight", (E, I_EXP, H), Q.Q4_K) for n in ("gate", "up"))
        yield f"{b}.ffn_down_exps.weight", (E, H, I_EXP), Q.Q6_K
        yield from ((f"{b}.ffn_{n}_shexp.weight", (I_EXP, H), Q.Q4_K) for n in ("gate", "up"))
        yield f"{b}.ffn_down_shexp.weight", (H, I_EXP), Q.Q6_K


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure(path: str, prompt: int = 16, steps: int = 32) -> None:
    """Resident memory after Engine.load (gguf weights), then greedy decode steps of one sequence."""
    import torch

    from turnkv.cache.specs import make_caches
    from turnkv.engine.engine import Engine

    t0 = time.perf_counter()
    model = Engine.load(path, weights="gguf", progress=False).model
    gc.collect()
    print(f"load {time.perf_counter() - t0:.1f} s, resident {rss_mb():.0f} MB, file {Path(path).stat().st_size / 2**20:.0f} MB")
    caches = make_caches(model.cache_specs())
    x = torch.arange(3, 3 + prompt)
    with torch.no_grad():
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            x = model.step(x, caches, logits="last").float().reshape(-1).argmax().reshape(1)
            times.append(time.perf_counter() - t)
    decode = sorted(times[1:])
    print(f"decode {1 / decode[len(decode) // 2]:.2f} tok/s (median of {len(decode)} steps), resident {rss_mb():.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--measure", action="store_true", help="measure OUT instead of writing it")
    args = ap.parse_args()
    if args.measure:
        measure(args.out)
        return
    src = GGUFReader(FIXTURE)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = GGUFWriter(args.out, ARCH)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        w.add_string(key, src.fields[key].contents())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        w.add_array(key, src.fields[key].contents())
    w.add_array("tokenizer.ggml.token_type", src.fields["tokenizer.ggml.token_type"].contents())
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(0)
    w.add_block_count(args.layers), w.add_context_length(4096), w.add_embedding_length(H)
    w.add_feed_forward_length(I_DENSE), w.add_head_count(HQ), w.add_head_count_kv(HK)
    w.add_key_length(D), w.add_value_length(D), w.add_rope_dimension_count(D // 2)
    w.add_rope_freq_base(1000000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(E), w.add_expert_used_count(USED), w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(I_EXP), w.add_leading_dense_block_count(args.dense)
    w.add_uint32(f"{ARCH}.expert_gating_func", 2), w.add_expert_weights_scale(1.0), w.add_expert_weights_norm(True)
    w.add_uint32(f"{ARCH}.expert_group_count", 1), w.add_uint32(f"{ARCH}.expert_group_used_count", 1)
    rng = np.random.default_rng(0)
    for name, shape, qtype in tensors(args.layers, args.dense, vocab):
        add(w, name, shape, qtype, rng)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
