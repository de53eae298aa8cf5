"""Speculative decoding on the bundled models as served (gguf weights, fp16 KV, chat template):
a code-edit reply, greedy and seeded-sampled, has the same token ids with ngram drafts as
without, and the drafts were really taken (docs/speculative.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

import native
from turnkv.engine.sampling import SamplingParams

SOURCE = (Path(__file__).resolve().parent.parent / "turnkv" / "engine" / "text.py").read_text()[:900]
MESSAGES = [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + SOURCE + "\n```\n\nRewrite it "
             "with the class StopMatcher renamed to StopStrings. Reply with the complete file only."}]


@pytest.fixture(scope="module", params=["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def loaded(request):
    from turnkv import kernels
    from turnkv.loading.bundled import find_bundled
    from turnkv.loading.model import load_model

    if not kernels.native_available():
        native.missing("the native kernels")
    if not find_bundled(request.param)[0]:
        pytest.skip(f"needs the bundled {request.param}")
    return load_model(request.param, weights=None, progress=False)


@pytest.mark.real
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.7, top_p=0.95, seed=5)],
                         ids=["greedy", "sampled"])
def test_code_edit_reply_is_the_same_with_drafts(loaded, params):
    from turnkv.engine.engine import Engine
    from turnkv.prompt_cache.store import PromptCache

    def run(mode):
        eng = Engine(loaded.net, loaded.tokenizer, fingerprint=loaded.fingerprint, weights=loaded.weights,
                     kv_mode="fp16", prompt_cache=PromptCache(0), speculative=mode)
        return eng.generate(eng.chat_request(MESSAGES, SamplingParams(max_tokens=48, **params)))

    plain, drafted = run("off"), run("ngram")
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    assert drafted.stats.speculative == "ngram" and drafted.stats.accepted > 0
