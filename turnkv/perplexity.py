"""``turnkv perplexity``: a text's perplexity under a model, chunked as llama.cpp's llama-perplexity
chunks it, so a quant type's quality reads the same in both.

The text is tokenized once (with BOS when the model's vocabulary adds one) and cut into
``n_ctx``-token chunks; a tail shorter than a chunk is dropped. Each chunk runs from empty caches,
its first token replaced by BOS when the vocabulary adds one, and only its second half is scored:
the logits at positions ``n_ctx // 2 .. n_ctx - 2`` against the tokens that follow them, so every
scored token sees at least half a chunk of context. The estimate is exp(mean NLL) over all scored
tokens so far; its +/- is llama.cpp's: the standard error of the mean NLL times the perplexity.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_CTX = 512
DEFAULT_BATCH = 512
SOFTMAX_ROWS = 64      # logit rows turned to float64 at once (a 262k vocabulary: 134 MB)


@dataclass
class Scores:
    """Running sums of the scored tokens' negative log-likelihoods (nats)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    running: list[float] = field(default_factory=list)    # the estimate after each chunk

    def add(self, nlls: torch.Tensor) -> None:
        self.nll += float(nlls.sum())
        self.nll2 += float((nlls * nlls).sum())
        self.count += nlls.numel()

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def uncertainty(self) -> float:
        """llama-perplexity's +/-: sqrt(var(NLL) / (count - 1)) * PPL (NaN when undefined)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return float("nan")
        return math.sqrt(var / (self.count - 1)) * self.ppl


def chunk_count(n_tokens: int, n_ctx: int, limit: int | None = None) -> int:
    """How many whole chunks llama-perplexity evaluates; it refuses a text under two chunks."""
    if n_ctx < 4:
        raise ValueError(f"--ctx-size must be at least 4, got {n_ctx}")
    if n_tokens < 2 * n_ctx:
        raise ValueError(f"perplexity needs at least {2 * n_ctx} tokens with a context of {n_ctx}; "
                         f"the text tokenizes to only {n_tokens}")
    n = n_tokens // n_ctx
    return n if limit is None or limit <= 0 else min(limit, n)


def chunk_tokens(tokens: Sequence[int], index: int, n_ctx: int, bos: int | None) -> list[int]:
    """Chunk ``index`` of ``tokens``, its first token replaced by ``bos`` (when not None)."""
    chunk = list(tokens[index * n_ctx:(index + 1) * n_ctx])
    if bos is not None:
        chunk[0] = bos
    return chunk


def token_nlls(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits[i])[targets[i]] per row, in float64."""
    out = []
    for r in range(0, logits.shape[0], SOFTMAX_ROWS):
        rows = logits[r:r + SOFTMAX_ROWS].double()
        out.append(torch.logsumexp(rows, -1) - rows.gather(1, targets[r:r + SOFTMAX_ROWS, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def score_chunk(step: Callable, chunk: list[int], caches: list, batch: int) -> torch.Tensor:
    """The NLLs of ``chunk``'s second half: the chunk runs in ``batch``-token forwards over
    ``caches`` (empty), logits asked only where a scored position falls."""
    n_ctx, first = len(chunk), len(chunk) // 2
    ids = torch.tensor(chunk, dtype=torch.long)
    nlls = []
    for start in range(0, n_ctx, batch):
        end = min(start + batch, n_ctx)
        if end <= first:       # nothing scored here: fill the caches only
            step(ids[start:end], caches, "none")
            continue
        logits = step(ids[start:end], caches, "all")
        lo, hi = max(first, start), min(end, n_ctx - 1)    # the last position predicts nothing here
        if hi > lo:
            nlls.append(token_nlls(logits[lo - start:hi - start], ids[lo + 1:hi + 1]))
    return torch.cat(nlls)


def evaluate(model, tokens: Sequence[int], n_ctx: int, *, bos: int | None, batch: int = DEFAULT_BATCH,
             chunks: int | None = None, kv_mode: str = "native", device="cpu",
             on_chunk: Callable[[int, Scores], None] | None = None) -> Scores:
    """Score ``tokens`` chunk by chunk (see the module doc) with a turnkv ``model``."""
    from .cache.specs import default_modes, make_caches

    n_chunks = chunk_count(len(tokens), n_ctx, chunks)
    specs = model.cache_specs()
    modes = default_modes(specs, kv_mode)
    scores = Scores()
    with torch.inference_mode():
        for i in range(n_chunks):
            caches = make_caches(specs, model.dtype, device, modes)      # empty: each chunk stands alone
            scores.add(score_chunk(model.step, chunk_tokens(tokens, i, n_ctx, bos), caches, max(1, batch)))
            scores.running.append(scores.ppl)
            if on_chunk is not None:
                on_chunk(i, scores)
    return scores


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run(args) -> int:
    """Load the model as ``serve`` does, score the file, print llama-perplexity's lines."""
    from .engine.engine import AUTO_KV, auto_kv_mode
    from .launch import DTYPES, configure_process
    from .loading import bos_to_add
    from .loading.model import load_model

    text = read_text(args.file)       # a missing file fails before the model loads
    configure_process(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    loaded = load_model(args.model, dtype, args.weights, progress=not args.quiet, mmproj=False)
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model}: holds no tokenizer, so a text cannot be scored")
    kv_mode = auto_kv_mode(loaded.weights, dtype) if args.kv_cache_mode == AUTO_KV else args.kv_cache_mode
    bos = bos_to_add(args.model, loaded.tokenizer)
    tokens = ([bos] if bos is not None else []) + loaded.tokenizer.encode(text, add_special_tokens=False)
    n_chunks = chunk_count(len(tokens), args.ctx_size, args.chunks)
    if args.ctx_size > loaded.max_context:
        print(f"turnkv: warning: the model was trained on {loaded.max_context} tokens of context, "
              f"--ctx-size is {args.ctx_size}", file=sys.stderr)
    print(f"turnkv: {loaded.name}, weights {loaded.weights}, KV {kv_mode}, {torch.get_num_threads()} threads; "
          f"{len(tokens)} tokens, {n_chunks} chunks of {args.ctx_size}, batch {args.batch_size}, "
          f"BOS {'added' if bos is not None else 'not added'}", file=sys.stderr)
    if getattr(loaded.net, "gguf_types", None):     # per type: the kernel that runs it, or a float copy
        print(f"turnkv: GGUF kernels: {loaded.net.gguf_types}", file=sys.stderr)

    def show(i: int, scores: Scores) -> None:
        sys.stdout.write(f"[{i + 1}]{scores.running[-1]:.4f},")
        sys.stdout.flush()

    scores = evaluate(loaded.net, tokens, args.ctx_size, bos=bos, batch=args.batch_size, chunks=args.chunks,
                      kv_mode=kv_mode, on_chunk=show)
    print()
    print(f"Final estimate: PPL = {scores.ppl:.4f} +/- {scores.uncertainty:.5f}")
    return 0
