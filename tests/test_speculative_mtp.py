"""``--speculative mtp`` (docs/speculative.md, "MTP"): the Qwen 3.5 multi-token-prediction block as
the drafter. On a tiny random checkpoint with MTP weights, saved as released checkpoints have them
(``mtp.*``) and converted by llama.cpp's own converter (``blk.4.*`` / ``blk.4.nextn.*``;
tests/gguf_fixtures/families.py ``make_qwen3_5_mtp``):

- the block loads from the HF folder and from the GGUFs, the same block;
- its drafts equal a pure-PyTorch reference of the MTP formula written here from vLLM's
  qwen3_5_mtp.py (the decoder layer inside is transformers' own), on the same weights and the
  trunk's hidden states as transformers computes them, also after drafts were partly accepted;
- inside the engine, with drafts taken whole, in part and not at all, its proposals at every step
  equal a drafter built from scratch on the same history (its K/V follows each cut);
- token ids are identical with ``mtp`` and ``off``, greedy and seeded, alone and batched (beside a
  sequence that does not draft), with reuse, and drafts are produced (random weights: what they
  accept means nothing);
- a model without the block: an error at start and a 400-class ``ParamError`` per request."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnkv.engine.engine import Engine
from turnkv.engine.mtp import MTP, MtpDrafter
from turnkv.engine.sampling import ParamError, SamplingParams
from turnkv.engine.sequence import GenerationRequest, Result
from turnkv.engine.speculative import StepCosts
from turnkv.loading.model import load_model
from turnkv.models.batch import ALL, Batch
from turnkv.prompt_cache.store import PromptCache

FIXTURES = Path(__file__).parent / "gguf_fixtures"
HF = FIXTURES / "qwen3_5_mtp" / "hf"
VOCAB = 320
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.3, repetition_penalty=1.1, logprobs=2)


@pytest.fixture(scope="module")
def q8():
    return load_model(str(FIXTURES / "qwen3_5_mtp" / "qwen3_5_mtp-q8_0.gguf"), torch.float32, "gguf", False)


@pytest.fixture(scope="module")
def folder():
    return load_model(str(HF), torch.float32, "native", False)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def hidden_rows(trunk, ids: list[int], caches=None):
    """The trunk's final hidden states (before its final norm) of ``ids`` run on ``caches``."""
    from turnkv.cache.specs import make_caches

    caches = caches if caches is not None else make_caches(trunk.cache_specs())
    sink: list = []
    with torch.inference_mode():
        trunk.forward(Batch.build([(ids, caches, ALL)], head=False, hidden=sink))
    return sink[0], caches


# --- the reference: the MTP formula in plain PyTorch ---------------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen 3.5's RMSNorm: scale by (1 + w), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


class Reference:
    """``draft(history, k)``: the MTP drafts after ``history`` from scratch, with transformers'
    trunk for the hidden states H_i (after its final norm) and the formula
    ``out_i = norm(layer(fc([norm_e(embed(t_{i+1})) | norm_h(H_i)])))``, ``d = argmax(lm_head(out))``,
    chained on ``out`` and the drafted token, the layer (transformers' full-attention decoder layer
    with the ``mtp.layers.0`` weights) attending causally over every position."""

    def __init__(self):
        from transformers import Qwen3_5ForCausalLM
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

        self.hf = Qwen3_5ForCausalLM.from_pretrained(HF, attn_implementation="eager").eval()
        cfg = self.hf.config
        self.eps = cfg.rms_norm_eps
        self.w = {k[len("mtp."):]: v.float() for k, v in load_file(HF / "model.safetensors").items()
                  if k.startswith("mtp.")}
        self.layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index("full_attention")).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in self.w.items() if k.startswith("layers.0.")})

    def block(self, z: torch.Tensor) -> torch.Tensor:
        """The decoder layer over rows z [T, hidden] at positions 0..T-1, causal."""
        T = z.shape[0]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        rope = self.hf.model.rotary_emb(z[None], pos)
        return self.layer(z[None], position_embeddings=rope, attention_mask=mask, position_ids=pos)[0]

    @torch.no_grad()
    def draft(self, history: list[int], k: int) -> list[int]:
        ids = torch.tensor(history)
        H = self.hf.model(ids[None, :-1]).last_hidden_state[0]        # after the trunk's final norm
        embed = self.hf.model.embed_tokens.weight
        hidden, toks, out = list(H), list(history[1:]), []
        while len(out) < k:
            e = rms(embed[torch.tensor(toks)], self.w["pre_fc_norm_embedding.weight"], self.eps)
            h = rms(torch.stack(hidden), self.w["pre_fc_norm_hidden.weight"], self.eps)
            z = torch.cat([e, h], dim=-1) @ self.w["fc.weight"].t()
            last = rms(self.block(z)[-1], self.w["norm.weight"], self.eps)
            out.append(int((last @ self.hf.lm_head.weight.t()).argmax()))
            hidden.append(last)
            toks.append(out[-1])
        return out


@pytest.fixture(scope="module")
def reference():
    return Reference()


# --- loading ---------------------------------------------------------------------------------------

def test_the_block_loads_from_the_folder_and_the_ggufs_alike(folder):
    f32 = load_model(str(FIXTURES / "qwen3_5_mtp" / "qwen3_5_mtp-f32.gguf"), torch.float32, "native", False)
    assert folder.net.mtp is not None and f32.net.mtp is not None
    ids = tokens(1, 24)
    x, _ = hidden_rows(folder.net, ids)
    outs = []
    for m in (folder.net, f32.net):
        cache = m.mtp.new_cache("native")
        outs.append(m.mtp(m, torch.tensor(ids[1:] + [5]), x, 0, cache))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5


def test_a_checkpoint_without_the_block_has_none():
    plain = load_model(str(FIXTURES / "qwen3_5" / "qwen3_5-q8_0.gguf"), torch.float32, "gguf", False)
    assert plain.net.mtp is None
    with pytest.raises(ValueError, match="multi-token-prediction"):
        Engine(plain.net, None, speculative=MTP)
    eng = Engine(plain.net, None, speculative="ngram")
    with pytest.raises(ParamError, match="multi-token-prediction") as err:
        eng.check_request(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, speculative=MTP)))
    assert err.value.param == "speculative"


# --- the drafts ------------------------------------------------------------------------------------

def test_drafts_equal_the_reference_formula(folder, reference):
    trunk = folder.net
    prompt = tokens(2, 30)
    x, caches = hidden_rows(trunk, prompt)
    drafter = MtpDrafter(trunk)
    drafter.observe(0, x)
    history = prompt + [17]
    got = drafter.draft(history, 5)
    assert got == reference.draft(history, 5)
    other = prompt + [18]        # the same point with another next token: its row again
    assert drafter.draft(other, 3) == reference.draft(other, 3)
    assert drafter.draft(history, 5) == got
    # the step verifies [17, d1 .. d5]; say two drafts were taken and a new token followed: the
    # drafter keeps the rows of the accepted positions only, and its K/V follows
    step = [17] + got
    x2, _ = hidden_rows(trunk, step, caches)
    drafter.observe(len(prompt), x2)
    history = prompt + step[:3] + [(got[2] + 1) % VOCAB]
    assert drafter.draft(history, 4) == reference.draft(history, 4)
    assert drafter.draft(history, 2) == reference.draft(history, 2)     # asked again at the same point


def test_drafts_after_a_restored_prefix_start_from_the_first_computed_position(folder):
    """A prompt-cache hit gives no hidden states for the restored prefix: the block's context
    starts at the first position the sequence computes (RoPE at the true positions)."""
    trunk = folder.net
    prompt = tokens(3, 20)
    x, _ = hidden_rows(trunk, prompt)
    drafter = MtpDrafter(trunk)
    drafter.observe(12, x[12:])
    assert drafter.draft(prompt + [9], 3) and drafter.cache.offset == 8


# --- the engine: output identical, drafts made ----------------------------------------------------

def make_engine(model, speculative="off", budget=1 << 30) -> Engine:
    eng = Engine(model.net, None, fingerprint="spec-mtp", weights=model.weights, prompt_cache=PromptCache(budget),
                 slack=4, prefill_chunk=16, max_context=4096, speculative=speculative, draft_max=6)
    eng.spec.costs = StepCosts(window=0)     # drafts as the prior costs choose them
    return eng


def req(prompt, max_tokens=30, **params) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def run_together(eng: Engine, reqs: list[GenerationRequest]) -> list:
    results: dict[int, object] = {}
    for i, r in enumerate(reqs):
        eng.submit(r, lambda item, i=i: results.__setitem__(i, item) if isinstance(item, Result) else None)
    while len(results) < len(reqs):
        assert eng.step()
    return [results[i] for i in range(len(reqs))]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtp_changes_no_token_alone_batched_and_with_reuse(q8, params):
    prompts = [tokens(4, 30), tokens(5, 9), tokens(6, 40)]
    plain = [make_engine(q8, budget=0).generate(req(p, **params)).token_ids for p in prompts]
    eng = make_engine(q8, MTP)
    alone = [eng.generate(req(p, **params)) for p in prompts]
    assert [r.token_ids for r in alone] == plain
    assert all(r.stats.speculative == MTP for r in alone)
    # batched, one sequence drafting with mtp beside one that does not draft
    reqs = [req(prompts[0], **params), req(prompts[1], **params, speculative="off"), req(prompts[2], **params)]
    together = run_together(make_engine(q8, MTP), reqs)
    assert [r.token_ids for r in together] == plain
    # reuse: the same prompt again (an exact hit) and a longer one past a restored prefix
    again = eng.generate(req(prompts[0], **params))
    longer = prompts[0] + plain[0] + tokens(7, 5)
    assert again.token_ids == plain[0] and again.usage.cached_tokens > 0
    grown = eng.generate(req(longer, **params))
    assert grown.usage.cached_tokens > 0
    assert grown.token_ids == make_engine(q8, budget=0).generate(req(longer, **params)).token_ids
    assert eng.spec.drafted > 0 and eng.spec.verify_steps > 0


def test_per_request_mtp_and_its_stats(q8):
    eng = make_engine(q8)
    r = eng.generate(req(tokens(8, 25), 20, speculative=MTP))
    assert r.stats.speculative == MTP and r.stats.drafted > 0
    assert r.token_ids == make_engine(q8, budget=0).generate(req(tokens(8, 25), 20)).token_ids


class Checked(MtpDrafter):
    """The engine's mtp drafter (fed by the engine, cut back by its steps), checked at every draft
    against a drafter built from scratch on the same history (one forward of the trunk over it);
    it returns the plain run's continuation instead, a token in ``wrong`` of them corrupted, so that
    drafts are taken whole, in part and not at all, and the block's K/V must follow each cut."""

    def __init__(self, trunk, runs: list[list[int]], seen: list):
        super().__init__(trunk)
        self.runs, self.seen, self.rng = runs, seen, random.Random(0)

    def draft(self, history: list[int], k: int) -> list[int]:
        got = super().draft(history, k)
        fresh = MtpDrafter(self.trunk)
        fresh.observe(0, hidden_rows(self.trunk, history[:-1])[0])
        self.seen.append(got == fresh.draft(history, k) and len(got) == k)
        run = next((r for r in self.runs if r[:len(history)] == history), [])
        out = run[len(history):len(history) + k]
        return [(t + 1) % VOCAB if self.rng.random() < 0.3 else t for t in out]


def test_the_blocks_kv_follows_accepted_and_rejected_drafts_in_the_engine(q8):
    prompts = [tokens(9, 20), tokens(10, 12)]
    plain = [make_engine(q8, budget=0).generate(req(p, 40)).token_ids for p in prompts]
    seen: list = []
    eng = make_engine(q8, MTP, budget=0)
    eng.drafters[MTP] = lambda engine, seq: seq.drafter or Checked(engine.model, [p + o for p, o in
                                                                                    zip(prompts, plain)], seen)
    got = run_together(eng, [req(p, 40) for p in prompts])
    assert [r.token_ids for r in got] == plain
    assert len(seen) > 10 and all(seen)
    assert 0 < eng.spec.accepted < eng.spec.drafted
