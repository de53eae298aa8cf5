"""Reuse exactness through the engine for every family beyond llama / gemma3: a tiny random
transformers model saved with save_pretrained, loaded by turnkv's own loader, played through an
8-turn conversation with the prompt cache on and off (same greedy tokens, first-token logits within
1e-4, most of every later prompt cached), then an edit of an earlier user message (restored from
the boundary snapshot before the edit, never a wrong state) and a regenerate (served from the
stored prompt-end logits).

Geometry (every family): system 60 tokens, users 12, replies of 5 tokens (max_tokens 6; the last
sampled token is not in the cache, as a chat client appends only the text it got). Llama 4 runs with
attention_chunk_size 16, so the conversation (~170 tokens) crosses the chunk size ten times, and
the system prompt ends in the first 64-position KV block while user 1 ends in the second: no
longer entry can be truncated back to user 1's start, so its edit must come from the system
checkpoint. EXAONE 4, Ministral 3 / Ministral and gpt-oss run with a 16-token sliding window, so
the conversation crosses it ten times too (AFMoE as well). GLM-4 MoE is all full attention
(ALL_FULL): its reuse truncates the end-of-generation snapshot, and its regenerate prefills one token.
"""

from __future__ import annotations

import importlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from ssm_family_checks import perturb_vectors, save_and_load
from tiny import engine, request
from turnkv.cache.specs import FULL
from turnkv.models import ARCHITECTURES

VOCAB = 256
ATOL = 1e-4
SYSTEM, USER, REPLY_TOKENS, TURNS = 60, 12, 6, 8
CHUNK = 16           # Llama 4 attention_chunk_size
WINDOW = 16          # sliding window of the attention-only families (exaone4, ministral, gpt_oss)
EDIT_LATE = 4        # the later user message edited (1-based)
COVERED = {"llama", "gemma3", "gemma3_text",   # tests/test_engine_reuse.py
           "idefics3", "smolvlm",               # tests/test_family_smolvlm.py (reuse with and without images)
           "lfm2_vl"}                           # tests/test_family_lfm2_vl.py (gemma3: test_family_gemma3_vision.py)


# --------------------------------------------------------------------- tiny configs, per family


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2,
        conv_kernel=4, num_hidden_layers=3, chunk_size=32, use_bias=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        max_position_embeddings=512, initializer_range=0.05))


def _recurrent_gemma():
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
    return RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attention_window_size=16, conv1d_width=4, logits_soft_cap=5.0,
        w_init_variance_scale=4.0))   # the default init makes greedy repeat one token


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=CHUNK, no_rope_layer_interval=2, floor_scale=8,
        attn_scale=0.5, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM
    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, block_multiple_of=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3], conv_L_cache=3, conv_bias=True,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _granitemoehybrid():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_proj_bias=True, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=6.0,
        residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0, position_embedding_type="rope",
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _exaone4():
    from transformers import Exaone4Config, Exaone4ForCausalLM
    return Exaone4ForCausalLM(Exaone4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _ministral3():
    from transformers import Ministral3Config, Ministral3ForCausalLM
    rope = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 64,
            "max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}   # query scale steps every 64 positions
    return Ministral3ForCausalLM(Ministral3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=1024,
        rope_parameters=rope, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _ministral():
    from transformers import MinistralConfig, MinistralForCausalLM
    return MinistralForCausalLM(MinistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2))


BUILDERS = {"mamba2": _mamba2, "qwen3_next": _qwen3_next, "recurrent_gemma": _recurrent_gemma,
            "llama4_text": _llama4, "lfm2": _lfm2, "granitemoehybrid": _granitemoehybrid,
            "exaone4": _exaone4, "ministral3": _ministral3, "ministral": _ministral,
            "gpt_oss": _gpt_oss}


def _gemma4_text():
    from test_family_gemma4 import build   # 16-token window, KV sharing, per-layer embeddings
    return build()


def _kimi_linear():
    from test_family_kimi_linear import build   # KDA recurrent state + MLA latent KV + MoE
    return build()


def _rwkv7():
    from test_family_rwkv7 import build   # every layer recurrent: the WKV matrix state and two shift states
    return build()


BUILDERS.update({"gemma4_text": _gemma4_text, "kimi_linear": _kimi_linear, "rwkv7": _rwkv7})


def _bailing_hybrid():
    from test_family_bailing_hybrid import build   # KDA (bounded gate) + MLA with RoPE and head gate + MoE
    return build()


BUILDERS["bailing_hybrid"] = _bailing_hybrid


def _muse_glimmer():
    from test_family_muse_glimmer import build   # 16-token window, NoPE full layer, text path of the VLM
    return build()


BUILDERS["muse_glimmer"] = _muse_glimmer
# the released Gemma 4 folders load the same text model (tests/test_family_gemma4.py)
COVERED.add("gemma4")


def _qwen3_5_text():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.05))


def _qwen3_5_moe_text():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, initializer_range=0.05))


def _glm4_moe():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    return Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _afmoe():
    from transformers import AfmoeConfig, AfmoeForCausalLM
    hf = AfmoeForCausalLM(AfmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, route_scale=2.0, global_attn_every_n_layers=2, sliding_window=WINDOW,
        mup_enabled=True, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():   # transformers zero-inits the router, which would route every token alike
        for layer in hf.model.layers[1:]:
            layer.mlp.router.gate.weight.normal_(0.0, 0.3)
    return hf


def _qwen3():
    from test_family_qwen3 import qwen3_config
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM(qwen3_config())


def _qwen2():
    from test_family_qwen3 import qwen2_config
    from transformers import Qwen2ForCausalLM
    return Qwen2ForCausalLM(qwen2_config())


def _qwen3_moe():
    from test_family_qwen3 import qwen3_moe_config, routed
    from transformers import Qwen3MoeForCausalLM
    return routed(Qwen3MoeForCausalLM(qwen3_moe_config()))


BUILDERS.update({"qwen3": _qwen3, "qwen2": _qwen2, "qwen3_moe": _qwen3_moe})
BUILDERS.update({"qwen3_5_text": _qwen3_5_text, "qwen3_5_moe_text": _qwen3_5_moe_text, "glm4_moe": _glm4_moe,
                 "afmoe": _afmoe})
# families whose layers are all full attention: no prefill checkpoints, every reuse truncates the
# end-of-generation snapshot to the common prefix (as llama in tests/test_engine_reuse.py)
ALL_FULL = {"glm4_moe", "qwen2", "qwen3", "qwen3_moe"}
# the vision-language folders of Qwen 3.5 load the same text model (tests/test_family_qwen3_5.py) under
# M-RoPE with the vision tower (tests/test_family_qwen3_5_vl.py)
COVERED |= {"qwen3_5", "qwen3_5_moe"}
FAMILIES = sorted(t for t in ARCHITECTURES if t not in COVERED)


def module_missing(model_type: str) -> str | None:
    module = ARCHITECTURES[model_type].split(":")[0]
    try:
        importlib.import_module(f"turnkv.models.{module}")
    except ImportError as err:
        return f"turnkv.models.{module} is not importable yet: {err}"
    return None


# ------------------------------------------------------------------------------- conversation


@dataclass
class Played:
    """One conversation played with the cache on and off; ``on`` keeps its prompt cache."""

    on: object
    off: object
    history: list[list[int]]          # system, user 1, reply 1, ..., user 8
    results_on: list
    results_off: list


def rand_msg(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def play(on, off, rng: random.Random) -> Played:
    history, r_on, r_off = [rand_msg(rng, SYSTEM)], [], []
    for _ in range(TURNS):
        history.append(rand_msg(rng, USER))
        a = on.generate(request(history, REPLY_TOKENS))
        r_on.append(a)
        r_off.append(off.generate(request(history, REPLY_TOKENS)))
        history.append(a.token_ids[:-1])
    return Played(on, off, history[:-1], r_on, r_off)


def same(a, b) -> None:
    assert a.token_ids == b.token_ids
    diff = (a.first_logits - b.first_logits).abs().max().item()
    assert diff <= ATOL, f"first-token logits differ by {diff:.3g}"


def rewritten(original: list[int], rng: random.Random) -> list[int]:
    """A new message of the same length whose first token differs, so the edit starts exactly
    where the original message did."""
    first = 3 + (original[0] - 3 + 1) % (VOCAB - 3)
    return [first] + rand_msg(rng, len(original) - 1)


def boundary_before(history: list[list[int]], index: int) -> int:
    return sum(len(m) for m in history[:index])


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    done: dict[str, Played] = {}

    def get(model_type: str) -> Played:
        reason = module_missing(model_type)
        if reason:
            pytest.skip(reason)
        assert model_type in BUILDERS, f"{model_type} is registered but has no tiny config in {__name__}"
        if model_type not in done:
            torch.manual_seed(0)
            hf = BUILDERS[model_type]().eval()
            perturb_vectors(hf)
            model = save_and_load(hf, tmp_path_factory.mktemp(model_type))
            done[model_type] = play(engine(model), engine(model, budget=0), random.Random(1))
        return done[model_type]

    return get


# -------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("model_type", FAMILIES)
def test_eight_turns_cache_on_equals_off(played, model_type):
    p = played(model_type)
    assert (model_type in ALL_FULL) == all(s.kind == FULL for s in p.on.specs), "ALL_FULL is out of date"
    for turn, (a, b) in enumerate(zip(p.results_on, p.results_off), start=1):
        same(a, b)
        assert b.usage.cached_tokens == 0
        if turn > 1:
            assert a.usage.cached_tokens >= 0.8 * a.usage.prompt_tokens, (turn, a.usage, a.stats)
            assert a.stats.reuse_from == "prefix", (turn, a.stats)
    if model_type == "llama4_text":
        assert len(p.results_on[-1].token_ids) + p.results_on[-1].usage.prompt_tokens > 8 * CHUNK
    stats = p.on.prompt_cache.stats()
    assert stats["hits"] >= TURNS - 1 and stats["tokens_reused"] > 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_edit_first_user_message_restores_system_checkpoint(played, model_type):
    p = played(model_type)
    rng = random.Random(2)
    edited = [p.history[0], rewritten(p.history[1], rng)]
    a, b = p.on.generate(request(edited, REPLY_TOKENS)), p.off.generate(request(edited, REPLY_TOKENS))
    same(a, b)
    edit_at = boundary_before(edited, 1)
    if a.stats.reuse_from == "truncated":
        # attention-only families whose sliding window has not dropped the edit position yet
        # (exaone4, ministral, gpt_oss): a longer entry cut back to the edit is exact
        assert all(s.is_attention for s in p.on.specs), a.stats
        assert a.stats.restored_entry_length > edit_at, (a.stats, edit_at)
    else:
        # the system prompt's end is a message boundary: the prefill of turn 1 snapshotted it
        assert a.stats.restored_origin == "checkpoint", a.stats
        assert 0 < a.stats.restored_entry_length <= edit_at, (a.stats, edit_at)
    assert a.usage.cached_tokens == edit_at == SYSTEM


@pytest.mark.parametrize("model_type", FAMILIES)
def test_edit_later_user_message_restores_boundary_before_it(played, model_type):
    p = played(model_type)
    rng = random.Random(3)
    index = 2 * EDIT_LATE - 1                          # history[index] is user message EDIT_LATE
    edited = p.history[:index] + [rewritten(p.history[index], rng)]
    a, b = p.on.generate(request(edited, REPLY_TOKENS)), p.off.generate(request(edited, REPLY_TOKENS))
    same(a, b)
    edit_at = boundary_before(edited, index)
    assert 0 < a.usage.cached_tokens <= edit_at, (a.usage, edit_at)
    if a.stats.reuse_from == "truncated":
        # only attention-only layers could allow this; the recurrent families never truncate
        assert all(s.is_attention for s in p.on.specs), a.stats
        assert a.stats.restored_entry_length > edit_at
    else:
        # The boundary before user k is the end of reply k-1: the end-of-generation snapshot of
        # turn k-1 is that checkpoint (origin "generation"), or a prefill checkpoint.
        assert a.stats.restored_origin in ("checkpoint", "generation"), a.stats
        assert a.stats.restored_entry_length == a.usage.cached_tokens == edit_at, (a.stats, edit_at)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_regenerate_last_turn(played, model_type):
    p = played(model_type)
    last = p.history
    a = p.on.generate(request(last, REPLY_TOKENS))
    same(a, p.results_off[-1])
    if model_type in ALL_FULL:
        # no prompt-end snapshot (nothing needs one): turn 8's end-of-generation snapshot is cut back
        # to the prompt less its last token, whose logits were not stored
        assert a.stats.reuse_from == "truncated" and a.stats.restored_origin == "generation", a.stats
        assert a.usage.cached_tokens == a.usage.prompt_tokens - 1, (a.usage, a.stats)
        return
    # the prompt-end snapshot of turn 8 holds its logits: nothing is prefilled
    assert a.usage.cached_tokens == a.usage.prompt_tokens, (a.usage, a.stats)
    assert a.stats.reuse_from == "exact" and a.stats.restored_origin == "prompt", a.stats


@pytest.mark.parametrize("model_type", FAMILIES)
def test_three_conversations_at_once_equal_each_alone(played, model_type):
    """Continuous batching: three users' conversations advance through one engine in shared steps
    (decode tokens beside prefill chunks of another user's turn); every turn equals the same turn
    run alone with the cache off, and later turns restore from what the same engine stored."""
    p = played(model_type)
    eng = engine(p.on.model, max_seqs=3, max_batch_tokens=24)
    rng = random.Random(5)
    histories = [[rand_msg(rng, SYSTEM - 10 * u)] for u in range(3)]
    turns_left = [3, 2, 3]
    events: dict[int, list] = {u: [] for u in range(3)}
    inflight: dict[int, object] = {}
    checked = 0
    for _ in range(5000):
        for u in range(3):
            if u not in inflight and turns_left[u] > 0:
                histories[u].append(rand_msg(rng, USER))
                inflight[u] = request(histories[u], REPLY_TOKENS)
                eng.submit(inflight[u], events[u].append)
        if not inflight:
            break
        eng.step()
        for u in list(inflight):
            done = [e for e in events[u] if hasattr(e, "finish_reason")]
            if not done:
                continue
            got, req = done[0], inflight.pop(u)
            events[u].clear()
            same(got, p.off.generate(req))
            if len(histories[u]) > 2:
                assert got.usage.cached_tokens > 0, got.usage
            histories[u].append(got.token_ids[:-1])
            turns_left[u] -= 1
            checked += 1
    assert checked == 8 and eng.pending() == 0


# ------------------------------------------------------- `turnkv serve -m FOLDER` over HTTP

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300


@dataclass
class FolderServer:
    proc: subprocess.Popen
    log: Path
    url: str = ""

    @classmethod
    def start(cls, folder: Path) -> "FolderServer":
        log = folder.parent / f"{folder.name}-server.log"
        cmd = [sys.executable, "-m", "turnkv.cli", "serve", "-m", str(folder), "--port", "0",
               "--max-context", "1024"]
        with open(log, "wb") as out:    # a file, never a pipe nobody drains
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        return cls(proc, log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text[-3000:]}")
            found = re.search(r"serving \S+ at (http://[^\s]+)", text)
            if found:
                self.url = found.group(1)
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def folder_servers(tmp_path_factory):
    """One `turnkv serve -m FOLDER` per family, all started together (each loads a
    tokenizer-less folder that save_pretrained wrote)."""
    servers: dict[str, FolderServer] = {}
    try:
        for model_type in FAMILIES:
            if module_missing(model_type):
                continue
            torch.manual_seed(0)
            hf = BUILDERS[model_type]().eval()
            folder = tmp_path_factory.mktemp("serve") / model_type
            hf.save_pretrained(folder)
            servers[model_type] = FolderServer.start(folder)
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def completion(server: FolderServer, prompt: list[int]) -> dict:
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_serve_folder_reuses_across_requests(folder_servers, model_type):
    reason = module_missing(model_type)
    if reason:
        pytest.skip(reason)
    server = folder_servers[model_type]
    rng = random.Random(4)
    turn1 = rand_msg(rng, SYSTEM) + rand_msg(rng, USER)
    # a chat client re-sends the history: the first prompt, the reply (its ids are not returned
    # without a tokenizer, so any ids stand in for it) and the next user message
    turn2 = turn1 + rand_msg(rng, 3) + rand_msg(rng, USER)
    first, second = completion(server, turn1), completion(server, turn2)
    assert first["usage"]["prompt_tokens"] == len(turn1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["completion_tokens"] == 4 and first["choices"][0]["finish_reason"] == "length"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(turn1), second["usage"]
    stats = httpx.get(server.url + "/v1/cache/stats", timeout=30).json()
    assert stats["hits"] >= 1 and stats["tokens_reused"] >= len(turn1), stats


def test_serve_folder_text_prompt_is_a_client_error(folder_servers):
    server = next(iter(folder_servers.values()))
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    text = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert chat.status_code == 400 and "tokenizer" in chat.json()["error"]["message"]
    assert text.status_code == 400 and "tokenizer" in text.json()["error"]["message"]
