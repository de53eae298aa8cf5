"""Which kernel runs each GGUF type (turnkv.kernels.describe_types): the start-up banner and
`turnkv models` name the kernel of every type in a file, and name any type that runs on float32
copies instead of calling it native."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

import turnkv.kernels as tk
from turnkv.loading import gguf_type_summary

FIXTURE = Path(__file__).resolve().parent / "gguf_fixtures" / "llama" / "llama-q8_0.gguf"


def test_types_without_a_kernel_are_named_as_float_copies():
    tensors = [(Q.IQ4_XS, (64, 256)), (Q.IQ4_XS, (64, 256)), (Q.Q6_K, (32, 256)), (Q.F16, (64, 64)),
               (Q.BF16, (8, 64)), (Q.Q8_1, (64, 256)), (Q.Q4_K, (4, 64, 256)), (Q.Q3_K, (64, 256)),
               (Q.Q2_K, (64, 256)), (Q.F32, (64, 64)), (Q.F32, (64,))]
    line = tk.describe_types(tensors)
    native, floats, stored = line.split("; ")
    # a 3-D expert stack of a type with a kernel stays in its blocks (tests/test_gguf_experts.py)
    assert native == f"F16 x 1, Q2_K x 1, Q3_K x 1, Q4_K x 1, Q6_K x 1, IQ4_XS x 2, BF16 x 1: {tk.kernel_info()}"
    assert floats == "Q8_1 x 1: float32 copies (no kernel for the type or the layout)"   # no Q8_1 kernel
    assert stored == "F32 x 1: float32 as stored"          # the 1-D norm is left out
    # what a load really kept: a type's tensors it did not keep are float copies too
    assert tk.describe_types(tensors[:3], kept={Q.IQ4_XS: 1}).startswith(
        f"IQ4_XS x 1: {tk.kernel_info()}; Q6_K x 1, IQ4_XS x 1: float32 copies")


@pytest.mark.skipif(not FIXTURE.exists(), reason="GGUF fixture missing")
def test_banner_and_models_name_the_kernel_per_type(capsys):
    from turnkv.engine.engine import Engine
    from turnkv.launch import print_banner

    assert gguf_type_summary(FIXTURE) == f"Q8_0 x 16: {tk.kernel_info()}"     # its F32 tensors are 1-D norms
    eng = Engine.load(str(FIXTURE), weights="gguf", progress=False)
    print_banner(eng, 0, False)
    err = capsys.readouterr().err
    assert f"turnkv: GGUF kernels: Q8_0 x 16: {tk.kernel_info()}\n" in err
    assert "float32 copies" not in err
    assert gguf_type_summary(FIXTURE, quantized={}) == "Q8_0 x 16: float32 copies (no kernel for the type or the layout)"
