"""A forced call's arguments streamed from the new text only (turnkv/server/call_args.py): the sure
prefix fed a piece at a time is what a scan of the whole text so far gives (the scan it replaced,
kept here as the reference), at every piece; and a long call streams in time linear in its length
(every token rescanned the whole call before)."""

from __future__ import annotations

import json
import random
import time

import pytest

from turnkv.server import tools as T
from turnkv.server.call_args import NUMBER_CHARS, StableJson, canonical


def stable_json_whole(raw: str) -> tuple[int, bool]:
    """The whole-text scan StreamParser ran at every token before (tools.py, 8ad8700)."""
    if not raw.startswith(("{", "[")):
        return 0, False
    depth, i, n = 0, 0, len(raw)
    while i < n:
        c, after_separator = raw[i], i > 0 and raw[i - 1] in ",:"
        if (c.isspace() or after_separator) and not (c == " " and after_separator):
            return i, False
        if c == '"':
            j = i + 1
            while j < n and raw[j] != '"':
                if raw[j] != "\\":
                    j += 1
                    continue
                end = j + (6 if raw[j + 1:j + 2] == "u" else 2)
                if end > n or canonical(f'"{raw[j:end]}"') != f'"{raw[j:end]}"':
                    return j, False
                j = end
            if j >= n:
                return n, False
            i = j + 1
        elif c in "-0123456789":
            j = i
            while j < n and raw[j] in NUMBER_CHARS:
                j += 1
            if j >= n or canonical(raw[i:j]) != raw[i:j]:
                return i, False
            i = j
        else:
            depth += (c in "{[") - (c in "}]")
            i += 1
            if depth == 0 and c in "}]":
                return i, True
    return n, False


VALUES = [
    '{"city": "Paris", "days": 3, "units": "metric"}',
    '{"a": [1, -2.5, 3e10, true, false, null], "b": {"c": "d\\"e\\\\f\\n"}}',
    '{"s": "caf\u00e9 \u65e5\u672c \\u001f", "t": "\\/x"}',      # \/ reads back as / : the sure part ends there
    '{"n": 1.50, "m": 2}',                                          # 1.50 reads back as 1.5
    '{"s": "\\u00e9t\\u00e9"}',                                     # reads back as "été"
    '{"a":1}',                                                      # no space after the colon
    '{"a": 1,  "b": 2}',                                            # two spaces
    '[{"x": [[]]}, "tail"] trailing',
    '{"k": "<tool_call>\\n{\\"name\\": \\"x\\"}", "z": 0}',
    '{"a": -0, "b": 0.0, "c": 1E5, "d": 12}',
    'nope',
    '',
]


@pytest.mark.parametrize("value", VALUES)
def test_the_sure_prefix_fed_in_pieces_is_the_whole_texts_at_every_piece(value):
    rng = random.Random(len(value))
    for cuts in ([1] * len(value), [rng.randint(1, 7) for _ in value], [len(value)]):
        scan, at = StableJson(), 0
        assert scan.feed("") == stable_json_whole("")
        for size in cuts:
            if at >= len(value):
                break
            piece, at = value[at:at + size], min(len(value), at + size)
            assert scan.feed(piece) == stable_json_whole(value[:at]), value[:at]


def stream(parser: T.StreamParser, text: str, step: int) -> str:
    sent = ""
    for i in range(0, len(text), step):
        parser.push(text[i:i + step])
        parser.opened()
        sent += "".join(piece for _, piece, _ in parser.arguments())
    return sent


@pytest.mark.parametrize("lead,streamed", [("", None), ('"n": 1.50, ', '{"n": ')])
def test_a_long_call_streams_in_time_linear_in_its_length(lead, streamed):
    """Also when the value stops being sure early on (1.50 reads back as 1.5): the rest of the call
    is not scanned again at every token either."""
    def call_text(n: int) -> tuple[str, str]:
        text = json.dumps("ab\\\"c\u00e9 " * (n // 8), ensure_ascii=False)
        args = f'{{{lead}"path": "a.txt", "text": {text}, "n": 12}}'
        return f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>', args

    def best_seconds(n: int) -> float:
        text, args = call_text(n)
        best = float("inf")
        for _ in range(3):
            parser = T.StreamParser(T.HERMES, forced=["write_file", "read_file"])
            t0 = time.thread_time()
            assert stream(parser, text, 4) == (streamed if streamed is not None else args)
            best = min(best, time.thread_time() - t0)
        return best

    short, long = best_seconds(20_000), best_seconds(80_000)
    # 4x the length: ~4x the time (a scan of the whole call at every token was ~16x)
    assert long < 8 * short, (short, long)
