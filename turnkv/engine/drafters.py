"""The drafters of speculative decoding (docs/speculative.md, "Drafts"): what guesses the tokens
that follow a sequence. A drafter only proposes; verification (speculative.py ``verify_draft``)
keeps plain decoding's tokens whatever it guesses.

A drafter is an object whose ``draft(history, k)`` returns at most ``k`` tokens guessed to follow
``history`` (the sequence's prompt and output so far, its next token last), possibly none, and
whose ``kind`` names the drafter of its latest draft (what stats and /metrics count drafts under;
a drafter without one counts under its mode); it is made once per sequence by its mode's factory
in ``DRAFTERS``, called with the engine and the sequence (``factory(engine, seq)``). A mode is
added by adding its factory there.

- ``ngram`` (``NgramDrafter``): prompt lookup in the sequence's own prompt and output;
- ``cache`` (``CacheDrafter``): what followed the same history in an earlier request of the same
  tenant, from the prompt cache's stored token paths (a regenerated or retried request, a
  replayed agent loop);
- ``mtp`` (engine/mtp.py ``MtpDrafter``): the checkpoint's multi-token-prediction block;
- ``auto`` (``FirstOf``): the cache's draft where it has one, else the ngram's.
"""

from __future__ import annotations

from ..images import is_key
from .mtp import MTP, MtpDrafter

OFF, NGRAM, CACHE, AUTO = "off", "ngram", "cache", "auto"
# why a sequence of an engine whose default is auto decodes plainly: the engine's exactness check
# (spec_probe.py) has not run yet; it runs in the engine's first idle moment (Engine.run), so no
# request waits for it
AUTO_PENDING = "auto_check_pending"
NGRAM_MAX, NGRAM_MIN = 4, 2      # suffix lengths prompt lookup tries, longest first
FOLLOW_SPAN = 16                 # tokens a followed copy's match is checked over (NgramDrafter.followed)


class NgramDrafter:
    """Prompt lookup over one sequence's tokens: ``index[n]`` maps every n-gram to the position
    right after its latest occurrence, for occurrences ending before the newest token (the
    newest suffix must match something earlier, not itself). A copy the last draft came from is
    followed on while it matches longer than any lookup checks (``followed``)."""

    kind = NGRAM

    def __init__(self):
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        self.upto = 0          # n-grams ending before this position are indexed
        self.src, self.seen = -1, 0    # the last draft: history[src] guessed to follow history[:seen]

    def draft(self, history: list[int], k: int) -> list[int]:
        end = len(history)
        for e in range(max(self.upto, NGRAM_MIN), end):
            for n, table in self.index.items():
                if e >= n:
                    table[tuple(history[e - n:e])] = e
        self.upto = max(self.upto, end)
        at = self.followed(history, end)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if at is not None or end < n:
                continue
            at = self.index[n].get(tuple(history[end - n:]))
        self.src, self.seen = (at, end) if at is not None else (-1, 0)
        if at is None:
            return []
        return before_key(history[at:at + k])

    def followed(self, history: list[int], end: int) -> int | None:
        """The last draft's source, moved on with the history, while the tokens before it match
        the newest ones for more than ``NGRAM_MAX`` (up to ``FOLLOW_SPAN`` are compared): the
        longest match wins, and the index knows only the latest occurrence of the last 4 tokens.
        A copy of a text whose phrases repeat (an answer given again) jumped to the phrase's
        later occurrence there and lost the draft (SmolLM2's regenerate: 7 tokens drafted, 0
        taken, docs/measurements/2026-12-07-s23-spec.md)."""
        at = self.src + end - self.seen
        if self.src < 0 or at >= end:
            return None
        n = min(FOLLOW_SPAN, at)
        matched = 0
        while matched < n and history[at - 1 - matched] == history[end - 1 - matched]:
            matched += 1
        return at if matched > NGRAM_MAX else None


def before_key(tokens) -> list[int]:
    """``tokens`` up to the first image key (an image is never drafted: its key's rows are the
    image's embeddings, not a token's)."""
    out = list(tokens)
    return out[:next((i for i, t in enumerate(out) if is_key(t)), len(out))]


class CacheDrafter:
    """What followed the sequence's history in an earlier request of its tenant. The prompt cache
    stores each request's prompt and output when it ends (the ``generation`` entry), under the
    sequence's namespace (weights, KV modes, tenant: another tenant's paths are never seen), so
    the newest stored path that extends the whole history holds what followed it before: the draft
    is that path's next tokens (fewer than asked, or none, where the path ends sooner:
    ``cache.continuation``). The path is followed while the history goes on along it (each new
    token compared once); once it leaves the path or reaches its end the cache is asked again, but
    not while nothing was stored in the namespace since it last had nothing (``cache.version``):
    the history only grows, so no path extends it that did not extend it before. ``cache`` None
    (an engine without a prompt cache): no drafts."""

    kind = CACHE

    def __init__(self, cache, ns):
        self.cache, self.ns = cache, ns
        self.path: tuple[int, ...] = ()
        self.along = 0          # history[:along] == path[:along]
        self.missed = -1        # the namespace's ``version`` when the cache last had no path for the history

    def draft(self, history: list[int], k: int) -> list[int]:
        end = len(history)
        if not self.follow(history) and not self.find(history):
            return []
        return before_key(self.path[end:end + k])

    def follow(self, history: list[int]) -> bool:
        """True while the path goes on past the history and holds it."""
        path, end, i = self.path, len(history), self.along
        if len(path) <= end:
            return False
        while i < end and path[i] == history[i]:
            i += 1
        self.along = i
        return i == end

    def find(self, history: list[int]) -> bool:
        if self.cache is None or self.cache.version(self.ns) == self.missed:
            return False
        self.path = self.cache.continuation(self.ns, history) or ()
        self.along = len(history) if self.path else 0
        if not self.path:
            self.missed = self.cache.version(self.ns)
        return bool(self.path)


class FirstOf:
    """The first of ``drafters`` that has a draft (``auto``: the cache's, else the ngram's); its
    ``kind`` is the one whose draft was the latest."""

    def __init__(self, *drafters):
        self.drafters = drafters
        self.kind = getattr(drafters[0], "kind", None)

    def draft(self, history: list[int], k: int) -> list[int]:
        for d in self.drafters:
            out = d.draft(history, k)
            if out:
                self.kind = getattr(d, "kind", None)
                return out
        return []


def auto_drafter(engine, seq) -> FirstOf:
    """``auto``: the engine's cache and ngram drafters (a test's drafter put in for either too)."""
    return FirstOf(engine.drafters[CACHE](engine, seq), engine.drafters[NGRAM](engine, seq))


# mode -> the factory of a mode's drafter for one sequence: ``factory(engine, seq)`` (module doc).
# An engine copies this table (``Engine.drafters``), so a test can put its own drafter in.
# ``mtp``: the sequence's drafter, made when its first forward kept hidden rows for it (engine/mtp.py)
DRAFTERS = {NGRAM: lambda engine, seq: NgramDrafter(),
            CACHE: lambda engine, seq: CacheDrafter(engine.prompt_cache, seq.ns),
            MTP: lambda engine, seq: seq.drafter or MtpDrafter(engine.model),
            AUTO: auto_drafter}
MODES = (OFF, *DRAFTERS)
