"""GGUF file -> (architecture, HF-style config dict, transformers-named tensors).

The values match what transformers holds after
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`: same names, same
dequantized numbers (bit for bit), the same reversal of llama.cpp's q/k
permutation and of its "+1" on Gemma norm weights.

``reader`` parses the header, ``dequant`` turns tensor data into torch tensors, ``archs/``
holds one layout per family (``architecture`` is what a layout declares, ``metadata`` the
config-reading helpers they share) and ``load`` puts them together.
"""

from .architecture import GGUFArchitecture
from .archs import SUPPORTED_GGUF_ARCHITECTURES
from .dequant import FLOAT_TYPES, dequantize, dequantize_rows, gguf_kernel_supports, keeps_blocks, raw_rows
from .load import architecture_of, load_gguf, tensor_name_map
from .reader import GGUFArray, GGUFHeader, TensorInfo, fingerprint, read_header

__all__ = [
    "FLOAT_TYPES",
    "GGUFArchitecture",
    "GGUFArray",
    "GGUFHeader",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "TensorInfo",
    "architecture_of",
    "dequantize",
    "dequantize_rows",
    "fingerprint",
    "gguf_kernel_supports",
    "keeps_blocks",
    "load_gguf",
    "raw_rows",
    "read_header",
    "tensor_name_map",
]
