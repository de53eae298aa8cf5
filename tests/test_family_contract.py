"""The contract every tiny random family keeps, one row per family and one test per column; each
family's own oddities stay in its tests/test_family_<name>.py, whose ``tiny`` builds the model
(shared with the row through the ``tiny_pair`` fixture).

Columns here: parity with transformers on the same weights (a 300-token prompt's last logits; one
chunk, many chunks and decode; greedy == generate), the restore rule one token either side of the
boundary (sliding window or recurrent state) against a cold run, reuse == cold with reuse asserted
in every KV storage mode, and the weight formats. The other columns run over the same family names:
the 8-turn chat with the cache on == off, edits and regenerate (tests/test_family_reuse.py),
batched == alone (tests/test_batching.py) and GGUF == folder (tests/test_gguf_families.py, for the
families with a GGUF path); the last tests here tie those columns to this table."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pytest

from ssm_family_checks import check_parity, check_reuse, greedy, hf_greedy
from window_family_checks import (KV_MODE_ATOL, KV_MODES, WEIGHT_SPECS, boundary, check_kv_mode_reuse,
                                  check_long_prompt, check_weight_format, check_window_boundary)


@dataclass(frozen=True)
class Row:
    name: str                       # the model_type the row stands for
    module: str                     # tests/test_family_<module>.py
    parity: tuple                   # check_parity: prompt length, seed, chunk, decode
    greedy: tuple = (40, 7)         # prompt length, seed: 32 greedy tokens == transformers' generate
    varied: bool = True             # the greedy text is not one repeated token
    long: tuple | None = (300, 3)   # prompt length, seed: last-position logits
    rule: tuple | None = None       # ("window", prompt seed) or ("recurrent", prompt length, snapshot length)
    kv_atol: float | None = None    # reuse == cold in every KV mode, within this
    weights: str | None = None      # the builder whose model runs the weight formats
    tolerance: dict = field(default_factory=dict)
    builder: str = "tiny"           # the family file's function that builds the model
    gguf: str | None = None         # its folder in tests/gguf_fixtures: GGUF == folder

    def pair(self, tiny_pair):
        return tiny_pair(getattr(self.mod, self.builder))

    @property
    def mod(self):
        return importlib.import_module(f"test_family_{self.module}")


WINDOW, RECURRENT = ("window", 11), ("recurrent", 60, 37)
ROWS = [
    Row("afmoe", "afmoe", (90, 5, 7, 20), rule=WINDOW, kv_atol=KV_MODE_ATOL, weights="dense_routed",
        tolerance={"native": 0.05, "bf16": 0.05}, gguf="afmoe"),
    # 100 tokens: the 64-token KDA chunk is crossed inside the one-shot prefill; the MLA layers'
    # latent cache in each KV mode (the KDA state stays in the model dtype)
    Row("bailing_hybrid", "bailing_hybrid", (100, 5, 7, 12), greedy=(30, 7), rule=RECURRENT, kv_atol=KV_MODE_ATOL,
        weights="calm", gguf="bailing_hybrid"),
    # decode crosses the window: 40 + 32 greedy tokens slide it too
    Row("exaone4", "exaone4", (90, 5, 7, 20), rule=WINDOW, kv_atol=KV_MODE_ATOL, weights="tiny", gguf="exaone4"),
    # Gemma 4's K and V are RMS-normed (no 1/sqrt(d) scale on the scores), so one int8 step that a
    # ~1e-6 float32 difference flips moves the logits more than on the other families: measured
    # 2.3e-3 on logits of magnitude ~2.4 at one turn of six (0 at the others); a wrong restore moves
    # them by O(1). Its weight formats: tests/test_family_gemma4.py.
    Row("gemma4_text", "gemma4", (90, 5, 7, 20), rule=WINDOW, kv_atol=5e-3, gguf="gemma4"),
    Row("glm4_moe", "glm4_moe", (90, 5, 7, 12), kv_atol=KV_MODE_ATOL, weights="dense_routed", gguf="glm4_moe"),
    Row("gpt_oss", "gpt_oss", (90, 5, 7, 20), rule=WINDOW, kv_atol=KV_MODE_ATOL, weights="dense_routed",
        gguf="gpt_oss"),
    Row("granitemoehybrid", "granitemoehybrid", (70, 3, 7, 10), long=None, rule=RECURRENT),
    Row("kimi_linear", "kimi_linear", (100, 5, 7, 12), greedy=(30, 7), rule=RECURRENT, kv_atol=KV_MODE_ATOL,
        weights="calm", gguf="kimi_linear"),
    # bfloat16 moves the tiny LFM2's logits by 4.5% (bfloat16 compute) and 3.2% (bf16 weights) of
    # their scale, measured; afmoe's limits
    Row("lfm2", "lfm2", (80, 3, 7, 10), long=None, rule=RECURRENT, weights="tiny",
        tolerance={"native": 0.05, "bf16": 0.05}, gguf="lfm2"),
    # 100 tokens: six attention chunks, and the live chunked buffers drop whole blocks; 40 + 32
    # greedy tokens cross four chunk boundaries while decoding (its restore rule:
    # tests/test_family_llama4.py)
    Row("llama4_text", "llama4", (100, 3, 7, 10), long=None),
    Row("mamba2", "mamba2", (80, 3, 7, 10), varied=False, long=None, rule=RECURRENT),
    # 150 tokens and 50 + 32 greedy ones cross the window and the query-scale steps every 64
    Row("ministral3", "ministral", (150, 5, 23, 25), greedy=(50, 7), rule=WINDOW, kv_atol=KV_MODE_ATOL,
        weights="tiny3", builder="tiny3", gguf="ministral"),
    Row("ministral", "ministral", (70, 4, 9, 12), greedy=(40, 6), varied=False, long=(300, 2), rule=("window", 12),
        builder="tiny1"),
    Row("muse_glimmer", "muse_glimmer", (90, 5, 7, 20), rule=WINDOW, kv_atol=KV_MODE_ATOL, weights="calm",
        gguf="muse_glimmer"),
    # the 300-token prompt in chunks of 37 and decode; the full-attention layer stores its KV in
    # each mode, the delta-net state stays float32
    Row("qwen3_5_text", "qwen3_5", (300, 3, 37, 8), greedy=(30, 7), varied=False, builder="tiny_dense",
        gguf="qwen3_5"),
    Row("qwen3_5_moe_text", "qwen3_5", (300, 3, 37, 8), greedy=(30, 7), varied=False, rule=("recurrent", 70, 41),
        kv_atol=KV_MODE_ATOL, weights="all_routed", builder="tiny_moe", gguf="qwen3_5_moe"),
    # llama's attention with q/k norms (Qwen 3) or q/k/v biases (Qwen 2)
    Row("qwen3", "qwen3", (90, 5, 7, 20), kv_atol=KV_MODE_ATOL, weights="tiny", gguf="qwen3"),
    Row("qwen2", "qwen3", (90, 5, 7, 20), kv_atol=KV_MODE_ATOL, weights="tiny_qwen2", builder="tiny_qwen2",
        gguf="qwen2"),
    Row("qwen3_moe", "qwen3", (90, 5, 7, 12), kv_atol=KV_MODE_ATOL, weights="all_routed", builder="tiny_moe",
        gguf="qwen3_moe"),
    Row("qwen3_next", "qwen3_next", (100, 3, 7, 10), greedy=(30, 7), varied=False, long=None, rule=RECURRENT),
    Row("recurrent_gemma", "recurrent_gemma", (80, 3, 7, 10), greedy=(30, 7), varied=False, long=None,
        rule=RECURRENT),
    # the reference (rwkv7-hf) runs token by token over 128-row padded projections: no 300-token prompt
    Row("rwkv7", "rwkv7", (80, 3, 7, 10), long=None, rule=RECURRENT, weights="tiny", gguf="rwkv7"),
]
BY_NAME = {row.name: row for row in ROWS}
# the registry entry each row's model_type resolves to
REGISTERED = {"afmoe": "afmoe:AfmoeModel", "bailing_hybrid": "bailing_hybrid:BailingHybridModel",
              "exaone4": "exaone4:Exaone4Model", "gemma4_text": "gemma4:Gemma4Model", "glm4_moe": "glm4_moe:Glm4MoeModel",
              "gpt_oss": "gpt_oss:GptOssModel", "granitemoehybrid": "granitemoehybrid:GraniteMoeHybridModel",
              "kimi_linear": "kimi_linear:KimiLinearModel", "lfm2": "lfm2:Lfm2Model", "llama4_text": "llama4:Llama4Model",
              "mamba2": "mamba2:Mamba2Model", "ministral3": "ministral:MinistralModel",
              "ministral": "ministral:MinistralModel", "muse_glimmer": "muse_glimmer:MuseGlimmerModel",
              "qwen3_5_text": "qwen3_5:Qwen3_5Model", "qwen3_5_moe_text": "qwen3_5:Qwen3_5Model",
              "qwen3_next": "qwen3_next:Qwen3NextModel", "qwen3": "llama:LlamaModel", "qwen2": "llama:LlamaModel",
              "qwen3_moe": "qwen3_moe:Qwen3MoeModel", "recurrent_gemma": "recurrent_gemma:RecurrentGemmaModel",
              "rwkv7": "rwkv7:Rwkv7Model"}


def rows(having: str = ""):
    return [pytest.param(row, id=row.name) for row in ROWS if not having or getattr(row, having) is not None]


@pytest.mark.parametrize("row", rows())
def test_registered(row):
    from turnkv.models import ARCHITECTURES, family_class

    module, cls = REGISTERED[row.name].split(":")
    assert ARCHITECTURES[row.name] == REGISTERED[row.name]
    assert family_class(row.name) is getattr(importlib.import_module(f"turnkv.models.{module}"), cls)


@pytest.mark.parametrize("row", rows())
def test_parity_chunks_and_decode(row, tiny_pair):
    model, hf = row.pair(tiny_pair)
    n, seed, chunk, decode = row.parity
    print(row.name, "parity", check_parity(model, hf, row.mod.prompt(n, seed=seed), chunk=chunk, decode=decode))


@pytest.mark.parametrize("row", rows("long"))
def test_last_logits_long_prompt(row, tiny_pair):
    model, hf = row.pair(tiny_pair)
    n, seed = row.long
    print(row.name, "last-position diff", check_long_prompt(model, hf, row.mod.prompt(n, seed=seed)))


@pytest.mark.parametrize("row", rows())
def test_greedy_matches_generate(row, tiny_pair):
    model, hf = row.pair(tiny_pair)
    p = row.mod.prompt(*row.greedy)
    ours = greedy(model, p, 32)    # a sliding window or an attention chunk moves while decoding
    # a family file may bring its reference's own greedy loop (one without transformers' generate)
    assert ours == getattr(row.mod, "hf_greedy", hf_greedy)(hf, p, 32)
    if row.varied:
        assert len(set(ours)) > 3, "degenerate tiny model: greedy text is one repeated token"


@pytest.mark.parametrize("row", rows("rule"))
def test_restore_one_token_inside_and_outside(row, tiny_pair):
    model, _ = row.pair(tiny_pair)
    if row.rule[0] == "window":
        window = row.mod.WINDOW
        t0 = check_window_boundary(model, row.mod.prompt(220, seed=row.rule[1]), 200, window)
        assert t0 == boundary(window, 200) == 128 + window - 1
    else:
        _, n, length = row.rule
        check_reuse(model, row.mod.prompt(n, seed=11), L=length)


@pytest.mark.parametrize("mode", KV_MODES)
@pytest.mark.parametrize("row", rows("kv_atol"))
def test_reuse_equals_cold_in_every_kv_mode(row, mode, tiny_pair):
    # a latent (MLA) cache or a shared K/V layer stores in the mode as any other; a recurrent state
    # stays in the model dtype
    check_kv_mode_reuse(row.pair(tiny_pair)[0], mode, atol=row.kv_atol)


@pytest.mark.parametrize("spec", WEIGHT_SPECS)
@pytest.mark.parametrize("row", rows("weights"))
def test_weight_formats_and_bfloat16(row, spec, tiny_pair):
    model, hf = tiny_pair(getattr(row.mod, row.weights))
    print(row.name, spec, check_weight_format(model, hf, spec, tolerance=row.tolerance))


def test_every_row_is_in_the_chat_and_batched_columns():
    from test_batching import FAMILIES as BATCHED
    from test_family_reuse import FAMILIES as CHATS
    from turnkv.models import ARCHITECTURES

    assert set(BY_NAME) <= set(ARCHITECTURES)
    assert set(BY_NAME) <= set(BATCHED) and set(BY_NAME) <= set(CHATS)


@pytest.mark.parametrize("row", rows("gguf"))
def test_gguf_column_holds_the_family(row):
    """tests/test_gguf_families.py compares each fixture's GGUF with its folder (logits, greedy, the
    quantized file, the tokenizer): the row's fixture is one of them and is this family."""
    import json

    from test_gguf_families import FAMILIES, FIXTURES

    assert row.gguf in FAMILIES
    config = json.loads((FIXTURES / row.gguf / "hf" / "config.json").read_text())
    assert row.name in (config["model_type"], config.get("text_config", {}).get("model_type"))
