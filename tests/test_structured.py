"""Structured output in-process: llguidance's mask over the real SmolLM2 tokenizer, and the engine
applying it per sequence: a constrained request and a free one batched together, the constrained
one's text valid against its schema, the free one's tokens equal to its run alone (the mask never
touches another sequence), and no mask work for sequences without a grammar. The HTTP path (20 of
20 json_schema replies valid) is in test_server_extras.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from turnkv.engine.engine import Engine, GenerationRequest
from turnkv.engine.grammar import Grammar, GrammarError
from turnkv.engine.sampling import SamplingParams
from turnkv.loading import load_tokenizer
from turnkv.loading.bundled import find_bundled
from turnkv.prompt_cache.store import PromptCache
from turnkv.server import tools as T

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    if not find_bundled("smollm2-135m")[0]:
        pytest.skip("bundled model smollm2-135m is not installed")
    return load_tokenizer("smollm2-135m")


def tiny_llama_vocab(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from turnkv.models.llama import LlamaModel

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    hf = LlamaForCausalLM(cfg).eval()
    return LlamaModel.from_checkpoint(cfg.to_dict(), hf.state_dict(), torch.float32)


def allowed(matcher, vocab: int) -> set[int]:
    masked = matcher.mask(torch.zeros(vocab))
    return set(torch.nonzero(torch.isfinite(masked)).flatten().tolist())


def test_the_mask_allows_exactly_the_schema(tok):
    grammar = Grammar.json_schema(tok, SCHEMA)
    m = grammar.matcher()
    doc = '{"ok": true, "n": 7}'
    first = allowed(m, tok.vocab_size)
    assert tok.encode("hello", add_special_tokens=False)[0] not in first
    assert not first & tok.eos_token_ids                       # an empty reply is not JSON
    for t in tok.encode(doc, add_special_tokens=False):
        assert t in allowed(m, tok.vocab_size), tok.decode([t])
        m.advance(t)
    assert allowed(m, tok.vocab_size) == tok.eos_token_ids     # complete: only the end of turn
    # a model with a larger (padded) vocabulary gets the padding masked too
    assert torch.isinf(grammar.matcher().mask(torch.zeros(tok.vocab_size + 64))[tok.vocab_size:]).all()


def test_json_object_accepts_any_object_and_refuses_bad_schemas(tok):
    m = Grammar.json_schema(tok, None).matcher()
    for t in tok.encode('{"a": [1, {"b": null}]}', add_special_tokens=False):
        assert t in allowed(m, tok.vocab_size)
        m.advance(t)
    assert m.accepting
    with pytest.raises(GrammarError):
        Grammar.json_schema(tok, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})


def test_forced_call_grammar_matches_the_template_layout(tok):
    tools = T.validate_tools([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}}])
    m = Grammar.lark(tok, T.call_grammar(T.HERMES, tools, ["get_weather"])).matcher()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for t in tok.encode(call, add_special_tokens=False):
        assert t in allowed(m, tok.vocab_size), tok.decode([t])
        m.advance(t)
    assert allowed(m, tok.vocab_size) == tok.eos_token_ids     # one call, then the end of turn


def test_a_constrained_and_a_free_sequence_batched_together(tok):
    """A tiny random Llama over SmolLM2's vocabulary with SmolLM2's tokenizer: the grammar makes its
    random output valid JSON; the free request batched beside it gives the same tokens as alone."""
    model = tiny_llama_vocab(tok.vocab_size)
    engine = Engine(model, tok, fingerprint="tiny-structured", prompt_cache=PromptCache(1 << 28),
                    max_context=1024, prefill_chunk=32)
    prompt_a = tok.encode("Reply in JSON:", add_special_tokens=False)
    prompt_b = tok.encode("Tell a story:", add_special_tokens=False)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    free_alone = engine.generate(GenerationRequest(prompt_b, params)).token_ids
    engine.prompt_cache.clear()

    results = {}
    constrained = GenerationRequest(prompt_a, SamplingParams(max_tokens=40, temperature=0.0),
                                    grammar=Grammar.json_schema(tok, SCHEMA))
    free = GenerationRequest(prompt_b, params)
    seqs = [engine.submit(constrained, lambda e: results.setdefault("a", []).append(e)),
            engine.submit(free, lambda e: results.setdefault("b", []).append(e))]
    assert seqs[0].matcher is not None and seqs[1].matcher is None    # no mask work for the free one
    while not all(s.done for s in seqs):
        engine.step()
    a, b = results["a"][-1], results["b"][-1]
    assert a.finish_reason == "stop"
    jsonschema.validate(json.loads(a.text), SCHEMA)
    assert b.token_ids == free_alone
    # the same request sampled at temperature 1 with many seeds: always valid
    for seed in range(5):
        r = engine.generate(GenerationRequest(prompt_a, SamplingParams(max_tokens=40, temperature=1.0, seed=seed),
                                              grammar=Grammar.json_schema(tok, SCHEMA)))
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_a_complete_grammar_keeps_allowing_only_the_end_of_turn(tok):
    """ignore_eos keeps sampling after the document is complete: the matcher stays usable."""
    m = Grammar.json_schema(tok, {"type": "boolean"}).matcher()
    for t in tok.encode("true", add_special_tokens=False):
        m.advance(t)
    for _ in range(3):
        assert allowed(m, tok.vocab_size) == tok.eos_token_ids
        m.advance(min(tok.eos_token_ids))
