"""Streaming text assembly with stop strings: text that could still be the start of a stop string
is held back until it is clear, so a stream never shows part of a stop sequence."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, tokenizer, stops: list[str] | None = None, skip_special_tokens: bool = True):
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
        self.stops = [s for s in (stops or []) if s]
        self.buffer = ""        # decoded text not yet emitted
        self.text = ""          # emitted text (the final answer once finished)
        self.stopped = False
        self.matched: str | None = None     # the stop string found (APIs that name it: Anthropic's)

    def _held_back(self, s: str) -> int:
        """Length of the longest suffix of ``s`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s)), best, -1):
                if s.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.buffer += self.decoder.push(token_id)
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := self.buffer.find(s)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])
                out = self.buffer[:at]
                self.text += out
                self.buffer = ""
                self.stopped = True
                return out
            keep = self._held_back(self.buffer)
        else:
            keep = 0
        out = self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        self.text += out
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self.buffer + self.decoder.flush()
        self.buffer = ""
        self.text += out
        return out
