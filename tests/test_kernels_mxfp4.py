"""MXFP4 (gpt-oss's experts) on the native kernels: a 4-bit E2M1 code per value (twice its value
from ggml's kvalues_mxfp4) and one E8M0 byte per 32 values, taken as 2^(e - 128) (ggml's
GGML_E8M0_TO_FP32_HALF). tests/test_kernels.py runs its every check on MXFP4 with realistic
scales; here: every exponent byte (the subnormal scales 0 and 1, the largest) decodes as gguf-py
and multiplies on every path as the reference does, rows of 17 bytes (K = 32) tile and run, and
the gpt-oss fixture's MXFP4 experts stay in their blocks, the banner naming the kernel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import gguf.quants
from gguf import GGMLQuantizationType as Q

import native
import turnkv.kernels as tk
from turnkv.kernels import GGUFStack, GGUFWeight, reference

ISAS = tk.available_isas()
FIXTURE = Path(__file__).resolve().parent / "gguf_fixtures" / "gpt_oss_mxfp4" / "gpt_oss_mxfp4-q8_0.gguf"


def weight(exponents: np.ndarray, n: int, k: int, seed: int) -> GGUFWeight:
    """Random codes, the blocks' E8M0 bytes drawn from ``exponents``."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.choice(exponents, size=(n, k // 32))
    return GGUFWeight.from_raw(blocks.reshape(n, -1), Q.MXFP4, (n, k))


def test_every_exponent_decodes_as_gguf():
    e = np.arange(256, dtype=np.uint8)
    want = gguf.quants.MXFP4.e8m0_to_fp32_half(e)
    assert torch.equal(reference.e8m0_half(torch.from_numpy(e)).view(torch.int32),
                       torch.from_numpy(want.view(np.int32)))
    w = weight(e, 16, 512, 0)     # 256 blocks: most exponents appear
    with np.errstate(over="ignore"):  # 2^127 x 6 is inf in float32, for gguf as for us
        ref = torch.from_numpy(gguf.quants.dequantize(w.rows().numpy(), Q.MXFP4).astype(np.float32))
        assert torch.equal(w.dequantize(), ref)
    u = reference.unpack(w.rows(), Q.MXFP4, 512)
    assert torch.equal((u["d"].unsqueeze(-1) * u["w"].float()).reshape(16, 512), ref)   # one exact product


@pytest.mark.parametrize("exponents, scale", [(range(0, 8), 1.0), (range(240, 255), 1e-30), (range(100, 140), 1.0)],
                         ids=["subnormal", "largest", "wide"])
def test_extreme_scales_every_path_equals_reference(exponents, scale):
    """Subnormal block scales (and their products with the activation scale), the largest ones
    against tiny activations: every path computes the reference's IEEE operations, no flushing."""
    w = weight(np.array(list(exponents), dtype=np.uint8), 37, 256, 1)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(2)) * scale
    ref = w.matmul(x, native=False)
    for isa in ISAS:
        for m in (1, 3, 8, 20):
            assert torch.equal(w.matmul(x[:m], isa=isa), ref[:m]), (isa, m)


@pytest.mark.parametrize("n", [1, 9, 64])
def test_rows_of_17_bytes(n):
    """K = 32: one block a row, an odd row size (the tiles move single bytes); stacks and row
    lookups of such rows (gpt-oss's down projection of the fixture)."""
    w = weight(np.arange(118, 126, dtype=np.uint8), n, 32, n)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(n))
    ref = w.matmul(x, native=False)
    for isa in ISAS:
        assert torch.equal(w.matmul(x, isa=isa), ref), isa
    assert torch.equal(w.lookup(torch.tensor([n - 1, 0])), w.dequantize()[[n - 1, 0]])
    stack = GGUFStack.from_raw(torch.cat([w.rows(), w.rows()]), Q.MXFP4, (2, n, 32))
    assert torch.equal(stack[1].matmul(x), w.matmul(x)) and torch.equal(stack.dequantize()[0], w.dequantize())


@native.needs(tk.native_available(), "the native GGUF kernels")
@pytest.mark.skipif(not FIXTURE.exists(), reason="gpt-oss MXFP4 fixture missing")
def test_gpt_oss_mxfp4_experts_stay_in_blocks():
    from turnkv.loading import gguf_type_summary, load_checkpoint

    ckpt = load_checkpoint(FIXTURE, dtype=torch.float32, progress=False, keep_quantized=True)
    stacks = [q for q in ckpt.quantized.values() if isinstance(q, GGUFStack)]
    assert stacks and all(s.qtype == Q.MXFP4 for s in stacks)
    assert not [n for n in ckpt.tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]   # no float copy
    summary = gguf_type_summary(FIXTURE, ckpt.quantized)
    assert f"MXFP4 x 6: {tk.kernel_info()}" in summary and "float32 copies" not in summary, summary
