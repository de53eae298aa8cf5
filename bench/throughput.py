"""Prefill and decode throughput: turnkv (each weight format) against transformers, side by side.

    python bench/throughput.py [--models smollm2-135m,gemma3-270m] [--reps 3]
                               [--prompt-tokens 1000] [--decode-tokens 32]
                               [--formats float32:native,bfloat16:native,bfloat16:int8,bfloat16:int4]

For every model it loads the bundled GGUF once with turnkv's loader (float32 tensors), builds one
turnkv model per format (``dtype:weights[:kv-cache-mode]``, see turnkv/models/weights.py) and transformers' model
(``from_pretrained(dir, gguf_file=..., dtype=float32)``, or ``--hf-load tensors``: the same
tensors put into ``from_config``, which skips transformers' slow GGUF dequantization). Then, for
each repetition, every engine in turn:

- prefill: one forward over a ``--prompt-tokens`` prompt from an empty cache, last-token logits
  only (transformers: ``logits_to_keep=1``), tok/s = prompt tokens / seconds;
- decode: ``--decode-tokens`` greedy steps continuing that prompt, one token per forward with the
  engine's own KV cache (transformers: its DynamicCache), tok/s = tokens / seconds.

Medians over the repetitions are printed with the ratio to transformers and the goals
(prefill >= 1.5x, decode >= 3x). Both engines run in this one process under the same thread and
malloc settings (``turnkv.launch.configure_process``, and glibc's heap on transparent huge pages as
``turnkv serve`` runs: ``ensure_hugepages``; ``--no-tune`` leaves glibc's defaults).
The last two columns compare each format with transformers float32 on the prompt's last-token
logits (max |diff|) and on the greedy continuation (tokens equal before the first mismatch).

``--nll-tokens N`` (default 1024; 0 skips it) adds a quality table: every format's mean NLL per
token on the first N tokens of turnkv/data/coriolanus.txt (the bench text of bench/kv_modes.py,
prefilled 256 tokens at a time) and its difference from the first format of ``--formats`` (the
float32 reference by default). The ``gguf`` format (the GGUF's own quantized blocks, native
kernels) is held to 0.01 nats/token there (issue 12). ``--no-transformers`` skips transformers
(speed ratios are then against the first format). The CPU model (``lscpu``) is printed.

``--llama-server PATH`` adds llama.cpp's server as a column: the bench starts it on the same GGUF
(``-t`` = our threads), sends the same prompt token ids (``cache_prompt: false``) and reads its
own timings (prompt and predicted tokens per second), median over the repetitions. The last
table sets every turnkv format against llama-server and against the machine's bandwidth limit:
the bytes of the model's weights (read once per decoded token) over a measured read bandwidth
(``torch.sum`` over 256 MB with the same threads). Goals (issue 12): decode >= 1.0x llama-server
and >= 70% of the limit, prefill >= 1.0x llama-server. Beside it, the K/V a decode step also reads
at that context (each attention layer's visible positions, in the format's KV mode) and the
decode speed against weights plus K/V, since a small model's K/V at 1000 tokens is a sizeable
share of what a step reads (SmolLM2: 23 MB of float16 K/V beside 97 MB of weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import cpu_model  # noqa: E402

from turnkv.cache.storage import make_store  # noqa: E402
from turnkv.cache.specs import CHUNKED, FULL, SLIDING, default_modes, make_caches  # noqa: E402
from turnkv.engine.sampling import greedy_token  # noqa: E402
from turnkv.launch import RECOMMENDED_MALLOC, configure_process, ensure_hugepages, hugepages_state  # noqa: E402
from turnkv.loading import load_checkpoint  # noqa: E402
from turnkv.models import family_class  # noqa: E402
from turnkv.models.weights import load_model, model_nbytes  # noqa: E402

PREFILL_GOAL, DECODE_GOAL = 1.5, 3.0
DEFAULT_FORMATS = "float32:native,bfloat16:native,float32:auto,bfloat16:auto,float32:gguf"
NLL_GOAL = 0.01      # gguf's allowed mean-NLL increase over float32 native, nats/token
NLL_CHUNK = 256
TEXT = Path(__file__).resolve().parent.parent / "turnkv" / "data" / "coriolanus.txt"




def read_bandwidth_gbs(reps: int = 7) -> float:
    """GB/s of a streaming read (torch.sum over 256 MB, the process's threads), median of reps."""
    x = torch.ones(64 * 1024 * 1024)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9



class LlamaServer:
    """llama.cpp's llama-server on one GGUF, for the side-by-side column."""

    def __init__(self, binary: str, gguf: str, threads: int, context: int):
        import socket
        import subprocess
        import tempfile

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([binary, "-m", gguf, "--port", str(self.port), "-t", str(threads),
                                      "-c", str(context), "-np", "1"], stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {Path(self.log.name).read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("llama-server did not start")

    def run(self, ids: list[int], n_predict: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) from llama-server's own timings."""
        import httpx
        r = httpx.post(self.url + "/completion", timeout=600, json={
            "prompt": ids, "n_predict": n_predict, "cache_prompt": False, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        t = r.json()["timings"]
        return float(t["prompt_per_second"]), float(t["predicted_per_second"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def bench_text_ids(tokenizer, n: int) -> torch.Tensor:
    lines = TEXT.read_text(encoding="utf-8").splitlines(keepends=True)
    return torch.tensor(tokenizer.encode("".join(lines[1:])), dtype=torch.int64)[:n]


def chunked_nll(model, dtype: torch.dtype, ids: torch.Tensor, chunk: int = NLL_CHUNK) -> float:
    """Mean NLL of ids[1:] given the prefix, prefilled ``chunk`` tokens at a time."""
    caches = make_caches(model.cache_specs(), dtype=dtype)
    total = 0.0
    for a in range(0, ids.shape[0] - 1, chunk):
        b = min(a + chunk, ids.shape[0] - 1)
        logp = torch.log_softmax(model.step(ids[a:b], caches, "all").float(), dim=-1)
        total -= logp.gather(-1, ids[a + 1:b + 1, None]).sum().item()
    return total / (ids.shape[0] - 1)


@dataclass
class Sample:
    prefill: list[float] = field(default_factory=list)   # tok/s per repetition
    decode: list[float] = field(default_factory=list)
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    load_s: float = 0.0
    nll: float | None = None
    bytes: int = 0
    kv_bytes: int = 0     # K/V a decode step reads at the bench's context (bytes)


def parse_format(spec: str) -> tuple[torch.dtype, str, str]:
    """``dtype:weights[:kv-mode]``, e.g. ``float32:int4:int8``"""
    dtype, _, rest = spec.partition(":")
    weights, _, kv = rest.partition(":")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], weights or "native", kv or "native"


def kv_read_bytes(model, dtype: torch.dtype, kv: str, context: int) -> int:
    """The K/V bytes one decode step reads with ``context`` tokens before it: every attention
    layer's keys and values (and their scales) over the positions its rule lets the new token see."""
    specs = model.cache_specs()
    total = 0
    for spec, mode in zip(specs, default_modes(specs, kv)):
        if not spec.is_attention:
            continue
        seen = {FULL: context, SLIDING: min(context, spec.window),
                CHUNKED: context % spec.chunk + 1 if spec.chunk else context}[spec.kind]
        total += make_store(mode, spec.heads, spec.head_dim, dtype, "cpu").bytes_per_token() * seen
    return total


def run_turnkv(model, dtype: torch.dtype, kv: str, prompt: torch.Tensor, steps: int):
    specs = model.cache_specs()
    caches = make_caches(specs, dtype=dtype, modes=default_modes(specs, kv))
    t0 = time.perf_counter()
    logits = model.step(prompt, caches, logits="last")
    t1 = time.perf_counter()
    first = logits.float().clone()
    # the engine's greedy pick (NumPy's argmax on the CPU: ~12 us on SmolLM2's 49k logits, ~24 on
    # Gemma 3's 262k, where torch.argmax took ~55 / ~330 us), so a decode step costs what it does
    # in the server
    tokens = [greedy_token(logits)]
    for _ in range(steps - 1):
        logits = model.step(torch.tensor([tokens[-1]]), caches, logits="last")
        tokens.append(greedy_token(logits))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, first, tokens


def run_transformers(hf, prompt: torch.Tensor, steps: int):
    t0 = time.perf_counter()
    out = hf(prompt[None], use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    first = out.logits[0, -1].float().clone()
    cache = out.cache
    tokens = [greedy_token(out.logits[0, -1])]
    for _ in range(steps - 1):
        out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        cache = out.cache
        tokens.append(greedy_token(out.logits[0, -1]))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, first, tokens


def load_transformers(ckpt, how: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if how == "gguf":
        src = Path(ckpt.source)
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    else:
        cfg = dict(ckpt.config)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf.load_state_dict(ckpt.tensors, strict=False)  # tied lm_head is absent from the tensors
    return hf.eval()


def bench_model(name: str, args) -> list[tuple]:
    t = time.perf_counter()
    ckpt = load_checkpoint(name, dtype=torch.float32, progress=False)
    print(f"[{name}] turnkv checkpoint loaded in {time.perf_counter() - t:.1f}s", flush=True)
    engines: dict[str, tuple] = {}
    samples: dict[str, Sample] = {}
    cls = family_class(ckpt.architecture)
    for spec in args.formats.split(","):
        dtype, weights, kv = parse_format(spec)
        t = time.perf_counter()
        if weights == "gguf":   # the GGUF's own blocks: loaded again, kept quantized (no float copy)
            qckpt = load_checkpoint(name, dtype=torch.float32, progress=False, keep_quantized=True)
            model = load_model(cls, qckpt.config, qckpt.tensors, dtype, weights, quantized=qckpt.quantized)
        else:
            model = load_model(cls, ckpt.config, ckpt.tensors, dtype, weights)
        engines[spec] = (model, dtype, kv)
        samples[spec] = Sample(load_s=time.perf_counter() - t, bytes=model_nbytes(model),
                               kv_bytes=kv_read_bytes(model, dtype, kv, args.prompt_tokens + args.decode_tokens // 2))
    hf = None
    if not args.no_transformers:
        t = time.perf_counter()
        hf = load_transformers(ckpt, args.hf_load)
        samples["transformers"] = Sample(load_s=time.perf_counter() - t)
        print(f"[{name}] transformers loaded ({args.hf_load}) in {samples['transformers'].load_s:.1f}s", flush=True)

    gen = torch.Generator().manual_seed(0)
    vocab = min(int(ckpt.config["vocab_size"]), 32000)
    prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=gen)
    server = None
    if args.llama_server:
        server = LlamaServer(args.llama_server, str(ckpt.source), torch.get_num_threads(),
                             args.prompt_tokens + args.decode_tokens + 64)
        samples["llama-server"] = Sample()
        server.run(prompt[:64].tolist(), 2)       # warm-up
    with torch.inference_mode():
        # warm-up: one short pass each (first-call allocations, oneDNN primitive creation)
        for spec, (model, dtype, kv) in engines.items():
            run_turnkv(model, dtype, kv, prompt[:64], 2)
        if hf is not None:
            run_transformers(hf, prompt[:64], 2)
        for rep in range(args.reps):
            for key in (["transformers"] if hf is not None else []) + list(engines):
                if key == "transformers":
                    p, d, first, toks = run_transformers(hf, prompt, args.decode_tokens)
                else:
                    p, d, first, toks = run_turnkv(*engines[key], prompt, args.decode_tokens)
                s = samples[key]
                s.prefill.append(args.prompt_tokens / p)
                s.decode.append((args.decode_tokens - 1) / d)
                s.last_logits, s.tokens = first, toks
            if server is not None:
                p, d = server.run(prompt.tolist(), args.decode_tokens)
                samples["llama-server"].prefill.append(p)
                samples["llama-server"].decode.append(d)
            print(f"[{name}] repetition {rep + 1}/{args.reps} done", flush=True)
    if server is not None:
        server.close()
    if args.nll_tokens:   # with or without llama-server (it has no NLL column)
        ids = bench_text_ids(ckpt.tokenizer, args.nll_tokens)
        for spec, (model, dtype, kv) in engines.items():
            t = time.perf_counter()
            with torch.inference_mode():
                samples[spec].nll = chunked_nll(model, dtype, ids)
            print(f"[{name}] {spec}: mean NLL {samples[spec].nll:.4f} over {ids.shape[0] - 1} tokens "
                  f"({time.perf_counter() - t:.1f}s)", flush=True)
    ref = samples["transformers" if hf is not None else next(iter(engines))]
    rows = []
    for key, s in samples.items():
        pf, dc = statistics.median(s.prefill), statistics.median(s.decode)
        rpf, rdc = pf / statistics.median(ref.prefill), dc / statistics.median(ref.decode)
        if s.last_logits is None:     # llama-server: speed only
            diff, agree = float("nan"), 0
        else:
            diff = (s.last_logits - ref.last_logits).abs().max().item()
            agree = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens)) if a != b), len(ref.tokens))
        rows.append((name, key, pf, rpf, dc, rdc, diff, agree, len(ref.tokens), s.load_s, s.nll, s.bytes,
                     s.kv_bytes))
    del engines, hf
    return rows


def print_table(rows: list[tuple], args) -> None:
    print()
    ref = "first format" if args.no_transformers else "hf"
    print(f"{cpu_model()}; prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens at that context, "
          f"median of {args.reps}; threads={torch.get_num_threads()}; ratios and logits against {ref}")
    head = (f"{'model':14s} {'engine':18s} {'prefill tok/s':>13s} {'x ref':>6s} {'decode tok/s':>12s} "
            f"{'x ref':>6s}  {'goals':7s} {'max|dlogit|':>11s} {'greedy=ref':>10s} {'build s':>7s}")
    print(head)
    print("-" * len(head))
    for name, key, pf, rpf, dc, rdc, diff, agree, n, load_s, *_ in rows:
        goals = "" if key == "transformers" or args.no_transformers else (
            ("P" if rpf >= PREFILL_GOAL else "-") + ("D" if rdc >= DECODE_GOAL else "-"))
        speed_only = diff != diff     # llama-server: no logits to compare
        same = ("-", "-") if speed_only else (f"{diff:.2e}", f"{agree}/{n}")
        print(f"{name:14s} {key:18s} {pf:13.0f} {rpf:6.2f} {dc:12.1f} {rdc:6.2f}  {goals:7s} "
              f"{same[0]:>11s} {same[1]:>10s} {load_s:7.1f}")
    print(f"goals: P = prefill >= {PREFILL_GOAL}x transformers, D = decode >= {DECODE_GOAL}x transformers")
    peer = {r[0]: r for r in rows if r[1] == "llama-server"}
    if peer:
        bw = args.bandwidth
        print()
        print(f"against llama-server (same GGUF, same threads) and the bandwidth limit (read {bw:.1f} GB/s); "
              "goals: decode >= 1.0x llama-server and >= 70% of the limit, prefill >= 1.0x llama-server")
        print(f"{'model':14s} {'engine':18s} {'weights MB':>10s} {'limit tok/s':>11s} {'decode % limit':>14s} "
              f"{'prefill x ls':>12s} {'decode x ls':>11s} {'K/V MB':>7s} {'% limit w+KV':>12s}")
        for name, key, pf, _, dc, _, _, _, _, _, _, nbytes, kv_bytes in rows:
            if key in ("transformers", "llama-server") or name not in peer:
                continue
            limit = bw * 1e9 / nbytes
            print(f"{name:14s} {key:18s} {nbytes / 1e6:10.1f} {limit:11.1f} {100 * dc / limit:13.0f}% "
                  f"{pf / peer[name][2]:12.2f} {dc / peer[name][4]:11.2f} {kv_bytes / 1e6:7.1f} "
                  f"{100 * dc * (nbytes + kv_bytes) / (bw * 1e9):11.0f}%")
        print("(% limit w+KV: the same decode speed against the weights plus the K/V a step reads at that "
              "context; the goal is stated on the weights alone)")
    nll_rows = [r for r in rows if r[10] is not None]
    if nll_rows:
        print()
        print(f"mean NLL on the first {args.nll_tokens} tokens of {TEXT.name} (chunks of {NLL_CHUNK}), "
              f"dNLL against each model's first format; gguf goal: dNLL <= {NLL_GOAL}")
        print(f"{'model':14s} {'engine':18s} {'NLL':>8s} {'dNLL':>8s}")
        base: dict[str, float] = {}
        for name, key, *_, nll, _, _ in nll_rows:
            base.setdefault(name, nll)
            d = nll - base[name]
            flag = ("  ok" if d <= NLL_GOAL else "  OVER GOAL") if ":gguf" in key else ""
            print(f"{name:14s} {key:18s} {nll:8.4f} {d:+8.4f}{flag}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--formats", default=None,
                    help="comma list of dtype:weights[:kv-cache-mode], e.g. float32:auto:int8 (default: "
                         f"{DEFAULT_FORMATS}; float32:gguf only where the native GGUF kernels are built)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="default: one per core")
    ap.add_argument("--hf-load", choices=("gguf", "tensors"), default="gguf",
                    help="gguf: transformers' own GGUF loader (slow); tensors: same weights via from_config")
    ap.add_argument("--no-tune", action="store_true", help="leave glibc malloc at its defaults")
    ap.add_argument("--nll-tokens", type=int, default=1024,
                    help="tokens of the bench text scored for mean NLL per format (0: skip)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip transformers; ratios against the first format")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary: adds it as a column (../shared/PEERS.md says how to build it)")
    args = ap.parse_args(argv)
    if argv is None and not args.no_tune:
        ensure_hugepages()    # as `turnkv serve` runs: glibc's heap on huge pages (turnkv/launch.py)
    if args.formats is None:
        from turnkv.models.weights import native_kernels_built

        args.formats = DEFAULT_FORMATS if native_kernels_built() else DEFAULT_FORMATS.replace(",float32:gguf", "")
    settings = configure_process(args.threads, malloc=None if args.no_tune else RECOMMENDED_MALLOC)
    args.bandwidth = read_bandwidth_gbs()
    print(f"{cpu_model()}: threads={settings.threads} malloc tuned={settings.malloc_applied}, {hugepages_state()}; "
          f"read bandwidth {args.bandwidth:.1f} GB/s", flush=True)
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args)
    print_table(rows, args)


if __name__ == "__main__":
    main()
