"""How much of a forced tool call's arguments, as the model writes them, can be streamed before the
call ends: the sure prefix of a JSON value that arrives a piece at a time (``StableJson``), worked
out from the new text only, so a call of n characters costs O(n) over its whole stream, not O(n)
per token (the whole value scanned again at every token was quadratic in a call's length)."""

from __future__ import annotations

import json

NUMBER_CHARS = frozenset("-+.0123456789eE")


def canonical(text: str) -> str | None:
    """``text`` (JSON) as the parsed call writes it (json.dumps with the grammar's separators)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return None


class StableJson:
    """``feed(text)`` with each new piece of a JSON value as the model writes it under a call
    grammar (separators ``, `` and ``: ``, no other whitespace) answers (how much of everything fed
    so far is sure to read the same once parsed and written again, whether the value ends there).
    A number is unsure until it ends, an escape until it is whole; one that json.dumps writes
    otherwise (``1.50``, ``\\u00e9``), or whitespace the grammar's writing has not, ends the sure
    part for good. The state between pieces: the scan's position, the bracket depth, whether it is
    inside a string, and the unfinished number or escape it stopped at (kept to scan again)."""

    def __init__(self):
        self.n = 0              # characters fed
        self.pos = 0            # where ``buf`` starts: everything before it is sure
        self.buf = ""           # from ``pos`` on: an unfinished number or escape, else empty
        self.depth = 0
        self.in_string = False
        self.prev = ""          # the character before ``pos`` (", " and ": " are the only spaces)
        self.result: tuple[int, bool] | None = None     # final: nothing fed later changes it

    def feed(self, text: str) -> tuple[int, bool]:
        if self.result is not None:
            return self.result
        self.n += len(text)
        buf = self.buf + text
        if self.n == 0:
            return 0, False
        if self.n == len(buf) and self.pos == 0 and buf[0] not in "{[":
            return self._final(0, False)
        k = 0
        while k < len(buf):
            step = self._string(buf, k) if self.in_string else self._value(buf, k)
            if step is None:        # stopped: final (result set) or waiting for more text at buf[k:]
                return self.result or self._wait(buf, k)
            k = step
        self.pos, self.buf = self.pos + len(buf), ""
        return self.n, False

    def _final(self, at: int, whole: bool) -> tuple[int, bool]:
        self.result = (at, whole)
        self.buf = ""
        return self.result

    def _wait(self, buf: str, k: int) -> tuple[int, bool]:
        self.pos, self.buf = self.pos + k, buf[k:]
        return self.pos, False

    def _string(self, buf: str, k: int) -> int | None:
        """Past one character (or a whole escape) of a string's contents; None to stop at k."""
        c = buf[k]
        if c == '"':
            self.in_string, self.prev = False, c
            return k + 1
        if c != "\\":
            return k + 1
        end = k + (6 if buf[k + 1:k + 2] == "u" else 2)
        if end > len(buf):
            return None
        if canonical(f'"{buf[k:end]}"') != f'"{buf[k:end]}"':
            self._final(self.pos + k, False)
            return None
        return end

    def _value(self, buf: str, k: int) -> int | None:
        """Past one token outside strings (a string's opening quote, a whole number, one other
        character); None to stop at k."""
        c = buf[k]
        after_separator = self.pos + k > 0 and self.prev in ",:"
        if (c.isspace() or after_separator) and not (c == " " and after_separator):
            self._final(self.pos + k, False)
            return None
        if c == '"':
            self.in_string, self.prev = True, c
            return k + 1
        if c in "-0123456789":
            j = k
            while j < len(buf) and buf[j] in NUMBER_CHARS:
                j += 1
            if j >= len(buf):
                return None
            if canonical(buf[k:j]) != buf[k:j]:
                self._final(self.pos + k, False)
                return None
            self.prev = buf[j - 1]
            return j
        self.depth += (c in "{[") - (c in "}]")
        self.prev = c
        if self.depth == 0 and c in "}]":
            self._final(self.pos + k + 1, True)
            return None
        return k + 1
