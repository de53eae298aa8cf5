"""RWKV-7's GGUF (llama.cpp's ``rwkv7`` layout, tests/gguf_fixtures/rwkv7: the converter's own output
for the tiny rwkv7-hf folder beside it) is held to the folder by tests/test_gguf_families.py; here,
what is this layout's own: the world tokenizer a released RWKV-7 GGUF carries is refused clearly."""

import gguf
import pytest

from turnkv.loading import load_checkpoint
from turnkv.loading.errors import ModelLoadError

FIXTURE = __import__("pathlib").Path(__file__).resolve().parent / "gguf_fixtures" / "rwkv7" / "rwkv7-f32.gguf"


def with_world_tokenizer(src, out):
    """The fixture with ``tokenizer.ggml.model`` "rwkv" (as a released file says), tensors unchanged."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, arch="rwkv7")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = "rwkv" if name == "tokenizer.ggml.model" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_world_tokenizer_is_refused_with_a_clear_error(tmp_path):
    out = tmp_path / "world.gguf"
    with_world_tokenizer(FIXTURE, out)
    with pytest.raises(ModelLoadError, match="RWKV's world tokenizer"):
        load_checkpoint(out, progress=False)
