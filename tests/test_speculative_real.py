"""Speculative decoding on the bundled models as served (gguf weights, fp16 KV, chat template):
a code-edit reply, greedy and seeded-sampled, has the same token ids with ngram drafts as
without, and the drafts were really taken; forced tool calls and a json_schema reply, whose
grammar's forced tokens are drafts too, the same alone, batched and with reuse
(docs/speculative.md)."""

from __future__ import annotations

import json
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

    from turnkv.engine.speculative import StepCosts

    def run(mode):
        eng = Engine(loaded.net, loaded.tokenizer, fingerprint=loaded.fingerprint, weights=loaded.weights,
                     kv_mode="fp16", prompt_cache=PromptCache(0), speculative=mode)
        eng.spec.costs = StepCosts(window=0)    # drafts as the prior costs choose them (tool_engine: why)
        return eng.generate(eng.chat_request(MESSAGES, SamplingParams(max_tokens=48, **params)))

    plain, drafted = run("off"), run("ngram")
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    assert drafted.stats.speculative == "ngram" and drafted.stats.accepted > 0


# --- drafts from the tokens a grammar forces (docs/speculative.md, "Forced tokens") -------------
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}}
LIST = {"type": "function", "function": {"name": "list_files", "description": "List the files of a folder.",
        "parameters": {"type": "object", "properties": {"directory": {"enum": ["turnkv/engine", "turnkv/server",
                                                                               "docs/measurements"]}},
                       "required": ["directory"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You review the turnkv repository with the tools you have."},
       {"role": "user", "content": "How does the engine verify a draft? Look at the code."}]
CALLED = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
    "name": "list_files", "arguments": json.dumps({"directory": "turnkv/engine"})}}]}
LISTING = {"role": "tool", "tool_call_id": "call_1",
           "content": "engine.py 17 kB\nspeculative.py 19 kB\nsequence.py 10 kB"}
SCHEMA = {"type": "object", "properties": {"file": {"type": "string"}, "lines": {"type": "integer"},
                                           "verdict": {"enum": ["exact", "approximate"]}},
          "required": ["file", "lines", "verdict"], "additionalProperties": False}


def grammar_bodies() -> list[dict]:
    """A forced call with an enum argument, a forced call after a tool round (the agent's next
    step: its prompt extends the first's), and a json_schema reply."""
    def call(name):
        return {"type": "function", "function": {"name": name}}
    return [{"messages": ASK, "tools": [READ, LIST], "tool_choice": call("list_files")},
            {"messages": [*ASK, CALLED, LISTING], "tools": [READ, LIST], "tool_choice": call("read_file")},
            {"messages": [ASK[1]], "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "verdict", "schema": SCHEMA}}}]


def tool_engine(loaded, mode, cache=0, **kw):
    from turnkv.engine.engine import Engine
    from turnkv.loading.tokenizer import chat_template_source
    from turnkv.prompt_cache.store import PromptCache

    from turnkv.engine.speculative import StepCosts

    tok = loaded.tokenizer.with_template(chat_template_source("chatml-tools"), note="chatml-tools")
    eng = Engine(loaded.net, tok, fingerprint=loaded.fingerprint, weights=loaded.weights, kv_mode="fp16",
                 prompt_cache=PromptCache(cache), speculative=mode, **kw)
    # drafts as the prior costs choose them: a loaded machine's step timings can make drafting look
    # too dear to try (CI under a parallel build: no forced draft in a reply); the tokens never depend on it
    eng.spec.costs = StepCosts(window=0)
    return eng


def chat(engine, body, params):
    from turnkv.server.requests import build_chat_request
    from turnkv.server.schemas import ChatCompletionRequest

    return build_chat_request(engine, ChatCompletionRequest(**body), SamplingParams(max_tokens=40, **params), "")


@pytest.mark.real
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "sampled"])
def test_grammar_replies_are_the_same_with_forced_drafts(loaded, params):
    """Forced tool calls and a json_schema reply: the same token ids with speculation on, one
    after another on one prompt cache (the second call's prompt extends the first's), then each
    again (restored), and batched (beside each other and a free reply); the forced tokens were
    drafted as their own kind and taken."""
    from test_engine_batching import run_all
    from turnkv.server.metrics import ServerMetrics
    from turnkv.server.worker import OK, JobOutcome

    plain = tool_engine(loaded, "off")
    want = [plain.generate(chat(plain, b, params)).token_ids for b in grammar_bodies()]
    free = plain.generate(plain.chat_request(MESSAGES, SamplingParams(max_tokens=40, **params))).token_ids
    eng, forced = tool_engine(loaded, "ngram", cache=1 << 30), 0
    for again in (False, True):       # the steps one after another on one prompt cache, then again
        got = [eng.generate(chat(eng, b, params)) for b in grammar_bodies()]
        forced += sum(g.stats.forced_drafted for g in got)
        assert [g.token_ids for g in got] == want
        assert all(0 < g.stats.forced_accepted <= g.stats.forced_drafted <= g.stats.drafted for g in got)
        assert got[1].stats.reuse_from != "none" and (got[0].stats.reuse_from != "none") == again
    metrics = ServerMetrics("m", False)
    metrics.observe(JobOutcome("chat", OK, got[0], 0.0, 0.0))
    assert eng.spec.as_dict()["forced"]["drafted"] == forced
    forced = got[0].stats.forced_drafted
    assert f'turnkv_spec_draft_tokens_total{{kind="forced"}} {float(forced)}' in metrics.render().decode()
    eng = tool_engine(loaded, "ngram", max_seqs=4)     # batched: the three and a free reply in one step
    reqs = [chat(eng, b, params) for b in grammar_bodies()]
    sinks, _ = run_all(eng, [*reqs, eng.chat_request(MESSAGES, SamplingParams(max_tokens=40, **params))])
    assert [s.result.token_ids for s in sinks] == [*want, free]
    assert all(s.result.stats.forced_accepted > 0 for s in sinks[:3])
