"""turnkv command line: serve | chat | generate | perplexity | models."""

from __future__ import annotations

import argparse
import sys

from .launch import DTYPES, engine_from, print_banner, sampling_from

# engine/scheduler.py's defaults, repeated so `--help` does not import torch (a test holds them equal)
DEFAULT_MAX_SEQS, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE = 8, 256, 64
# server/context.py's defaults, for the same reason
DEFAULT_MAX_MESSAGES, DEFAULT_MAX_CONNECTIONS = 2048, 1024
DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_IMAGE_CACHE_MB = 4096 * 4096, 256.0     # = turnkv/images.py's
# engine/drafters.py's MODES and engine/speculative.py's DEFAULT_DRAFT_MAX, for the same reason
SPECULATIVE_MODES, DEFAULT_DRAFT_MAX = ("off", "ngram", "cache", "mtp", "auto"), 7
# the names of turnkv.models.weights.FORMATS, listed here so `--help` does not import torch
WEIGHT_FORMATS = ("native", "bf16", "int8", "int4x2", "int4", "auto", "gguf")
# perplexity.py's DEFAULT_CTX and DEFAULT_BATCH, for the same reason
PPL_CTX, PPL_BATCH = 512, 512



def _count(text: str) -> int:
    """An argparse type: an integer >= 0 (refused at parse time, before the model loads)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("speculative decoding (docs/speculative.md)")
    d.add_argument("--speculative", default="auto", choices=list(SPECULATIVE_MODES),
                   help="draft tokens verified in one forward, output unchanged: off, ngram (its own text), cache "
                        "(an earlier request's continuation, same tenant), mtp (the checkpoint's MTP layers: Qwen 3.5) "
                        "or auto (cache, else ngram, once a check in the engine's first idle moment passed; default)")
    d.add_argument("--draft-max", type=int, default=DEFAULT_DRAFT_MAX, metavar="K",
                   help=f"longest draft per step (1..64, default {DEFAULT_DRAFT_MAX})")


def add_model_args(p: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", default=default_model,
                   help="bundled model name (see `turnkv models`), a .gguf file, or an HF folder")
    g.add_argument("--mmproj", default=None, metavar="FILE",
                   help="vision projector GGUF (llama.cpp's mmproj) for a text .gguf: SmolVLM / Idefics3, Gemma 3, "
                        "LFM2-VL, Qwen3.5-VL (default: an mmproj*.gguf beside the model file; docs/images.md)")
    g.add_argument("--no-mmproj", action="store_true", help="do not look for an mmproj*.gguf beside the model file")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype (default float32)")
    g.add_argument("--weights", default=None, choices=list(WEIGHT_FORMATS),
                   help="weight format: gguf (the GGUF's own quantized blocks, native kernels), "
                        "native (= --dtype, exact reference), bf16, int8, int4x2, int4, or auto (int4 "
                        "where the GGUF's own 4-bit blocks survive, two-pass int4 elsewhere). Default: "
                        "gguf for a GGUF model (Llama, Gemma 3) when the native kernels are built, "
                        "native otherwise; see docs/weights.md")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    g.add_argument("--threads", type=int, default=None, help="CPU compute threads (default: one per core)")
    g.add_argument("--adaptive-threads", default="on", choices=["on", "off"], help="GGUF models: fewer threads "
                   "while that is faster (a core busy elsewhere), same outputs (default on; docs/threads.md)")
    g.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--prefill-chunk", type=int, default=512, help="tokens per prefill chunk (default 512)")
    g.add_argument("--chat-template", default=None,
                   help="replace the model's chat template: a shipped one (chatml-tools: ChatML with Hermes "
                        "tool calls; taken automatically for a ChatML template without tools that renders "
                        "alike) or a .jinja file")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help=f"vision models: refuse images with more pixels than this (default {DEFAULT_MAX_IMAGE_PIXELS})")
    g.add_argument("--image-cache-mb", type=float, default=DEFAULT_IMAGE_CACHE_MB,
                   help="vision models: byte budget of cached image embeddings in MiB (default 256; docs/images.md)")
    add_speculative_args(p)
    c = p.add_argument_group("prompt cache")
    c.add_argument("--prompt-cache", dest="prompt_cache", action="store_true", default=True,
                   help="reuse model state across requests (default on)")
    c.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false", help="turn the prompt cache off")
    c.add_argument("--cache-budget-mb", type=float, default=2048.0,
                   help="byte budget of stored snapshots in MiB (0 disables the cache; default 2048)")
    c.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="disk tier: keep snapshots in DIR too (survives restarts); see docs/tiers.md")
    c.add_argument("--disk-cache-mb", type=float, default=10240.0,
                   help="byte budget of the disk tier in MiB, least recently used out first (default 10240)")
    c.add_argument("--redis-url", default=None, metavar="URL",
                   help="Redis tier (redis://host:port/db): snapshots shared by every server on it")
    c.add_argument("--redis-cache-mb", type=float, default=4096.0,
                   help="byte budget of this model's snapshots in Redis in MiB (default 4096)")
    c.add_argument("--redis-timeout-ms", type=float, default=500.0,
                   help="a Redis call slower than this counts as down; local tiers only for 5 s (default 500)")
    c.add_argument("--tier-keep-turns", type=_count, default=1, metavar="N",
                   help="disk / Redis tiers keep a conversation's newest turn and the ends of the N turns "
                        "before it; older entries of it are dropped (0 keeps all; default 1; docs/tiers.md)")
    c.add_argument("--swa-slack", type=int, default=256,
                   help="extra tokens kept on sliding-window layers so a reply can be edited/regenerated (default 256)")
    c.add_argument("--kv-cache-mode", default="auto", choices=["auto", "native", "bf16", "fp16", "int8", "int4"],
                   help="storage mode of attention KV (default auto: fp16 under the gguf weights at float32, "
                        "else native = the compute dtype; docs/kv_modes.md)")
    c.add_argument("--kv-boundary-layers", type=int, default=0,
                   help="keep the first and last N attention layers native (default 0)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def cmd_models(args) -> int:
    from .loading.bundled import list_bundled
    rows = list_bundled()
    print(f"{'name':<16} {'installed':<10} {'package':<28} path")
    for r in rows:
        print(f"{r['name']:<16} {'yes' if r['installed'] else 'no':<10} {r['package']:<28} {r.get('path') or ''}")
        if r["installed"] and r.get("path"):    # which kernel runs each GGUF type, or a float copy
            from .loading import gguf_type_summary
            print(f"{'':<16} GGUF types: {gguf_type_summary(r['path'])}")
    return 0


def cmd_generate(args) -> int:
    engine = engine_from(args)
    params = sampling_from(args)
    if args.raw or not engine.tokenizer.has_chat_template:
        req = engine.text_request(args.prompt, params)
    else:
        req = engine.chat_request([{"role": "user", "content": args.prompt}], params)
    gen = engine.stream(req)
    while True:
        try:
            ev = next(gen)
        except StopIteration as stop:
            result = stop.value
            break
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(result.stats.line(result.usage), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = engine_from(args)
    print_banner(engine, args.cache_budget_mb, args.prompt_cache)
    params = sampling_from(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        req = engine.chat_request(messages, params)
        gen = engine.stream(req)
        try:
            while True:
                try:
                    ev = next(gen)
                except StopIteration as stop:
                    result = stop.value
                    break
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            gen.close()
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        print(result.stats.line(result.usage), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
        if engine.idle_check:   # auto's check, while the reply is read (docs/speculative.md)
            engine.speculation_blocked()
        if engine.threads is not None:   # the next thread count's probe, too (docs/threads.md)
            engine.threads.idle()


def cmd_serve(args) -> int:
    from .server.serve import serve
    return serve(args)


def cmd_perplexity(args) -> int:
    from .perplexity import run
    return run(args)


def add_perplexity_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file, chunked as llama.cpp's llama-perplexity")
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="bundled model name (see `turnkv models`), a .gguf file, or an HF folder")
    p.add_argument("-f", "--file", required=True, help="the text file to score")
    p.add_argument("-c", "--ctx-size", type=int, default=PPL_CTX,
                   help=f"tokens per chunk; the second half of each is scored (default {PPL_CTX})")
    p.add_argument("-b", "--batch-size", type=int, default=PPL_BATCH,
                   help=f"tokens per forward within a chunk (default {PPL_BATCH})")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default all)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU compute threads (default: one per core)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="compute dtype (default float32)")
    p.add_argument("--weights", default=None, choices=list(WEIGHT_FORMATS),
                   help="weight format, as for serve (default: gguf for a GGUF when the kernels are built)")
    p.add_argument("--kv-cache-mode", default="auto", choices=["auto", "native", "bf16", "fp16", "int8", "int4"],
                   help="storage mode of attention KV, as for serve (default auto)")
    p.add_argument("-q", "--quiet", action="store_true", help="no loading progress bar")
    p.set_defaults(func=cmd_perplexity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the bundled models").set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate a reply to one prompt")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    a = p.add_argument_group("access and limits")
    a.add_argument("--api-key", default=None,
                   help="require this bearer token (one tenant, which may also flush and read /metrics)")
    a.add_argument("--api-keys", default=None, metavar="FILE",
                   help="one 'KEY TENANT' pair per line: each tenant its own cache namespace, budget share, "
                        "flush and stats; re-read on SIGHUP")
    a.add_argument("--admin-key", default=None,
                   help="bearer token that may flush every tenant and read global stats and /metrics")
    a.add_argument("--tenant-budget-mb", type=float, default=None,
                   help="prompt-cache bytes one tenant may hold; over it, its own oldest entries go first "
                        "(default: no per-tenant share)")
    a.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
                   help=f"messages per chat request (default {DEFAULT_MAX_MESSAGES})")
    a.add_argument("--max-n", type=int, default=16,
                   help="choices per request (the n field; they share one prefill of the prompt; default 16)")
    a.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="end a generation that has not finished S seconds after it arrived (408; default: none)")
    a.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers take longer than S seconds (default 10)")
    a.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="answer 408 to a request whose body takes longer than S seconds to arrive (default 30)")
    a.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open HTTP connections before new requests get 503 (default {DEFAULT_MAX_CONNECTIONS})")
    b = p.add_argument_group("batching")
    b.add_argument("--max-seqs", type=int, default=DEFAULT_MAX_SEQS,
                   help=f"sequences generating at once, decoded in one batch (default {DEFAULT_MAX_SEQS})")
    b.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                   help=f"tokens per engine step: every running sequence's next token plus prefill chunks (default "
                        f"{DEFAULT_MAX_BATCH_TOKENS}); a step that decodes nothing takes up to --prefill-chunk of prompt")
    b.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting for a slot before the server answers 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT", help="publish what the prompt cache can "
                   "restore as vLLM's KV events on a ZMQ PUB socket, e.g. tcp://*:5557 (docs/scale-out.md)")
    p.set_defaults(func=cmd_serve)
    add_perplexity_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.func in (cmd_serve, cmd_chat, cmd_generate, cmd_perplexity):
        from .launch import ensure_hugepages, read_ahead
        ensure_hugepages()   # a command that loads a model starts over once with glibc's huge-page heap
        read_ahead(args.model)   # the model file's disk reads beside the imports
    from .errors import user_errors
    try:
        return int(args.func(args) or 0)
    except user_errors() as err:
        print(f"turnkv: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
