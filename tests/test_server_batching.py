"""The server over the batching engine, in-process (real uvicorn on a loopback port, real engine on
a tiny random Llama): requests past --max-queue get 429 with Retry-After, the others are served
and equal their run alone, and concurrent streams interleave (one long request does not hold the
others back until it ends)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import serving
from tiny import engine, tiny_llama
from turnkv.server.app import create_app


@pytest.fixture(scope="module")
def server():
    model = tiny_llama()[0]
    eng = engine(model, max_seqs=2, max_queue=1, max_batch_tokens=32)
    with serving(create_app(eng), backlog=64) as url:
        yield url, model


def complete(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)


def test_queue_full_gets_429_and_the_rest_are_served(server):
    url, _ = server
    prompts = [[5 + i, 7, 9, 11 + i] * 10 for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda p: complete(url, p, 400), prompts))
    codes = [r.status_code for r in replies]
    assert codes.count(429) >= 1 and codes.count(200) >= 3, codes      # 2 running + 1 waiting at least
    for r in replies:
        if r.status_code == 429:
            assert r.headers.get("retry-after") == "1"
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
    assert httpx.get(url + "/health", timeout=5).json()["pending"] == 0
    assert complete(url, prompts[0], 3).status_code == 200      # room again once they are done


def test_a_short_request_finishes_while_a_long_one_streams(server):
    url, _ = server
    long_done = threading.Event()

    def long_stream():
        # a tokenizer-less model streams no text, only the final chunk: the stream ends when it ends
        body = {"prompt": [3, 4, 5] * 20, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        long_done.set()

    t = threading.Thread(target=long_stream)
    t.start()
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health", timeout=5).json()["pending"] < 1:     # the long one is running
        assert time.monotonic() < deadline
        time.sleep(0.01)
    short = complete(url, [9, 8, 7, 6], 5)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 5
    assert not long_done.is_set(), "the short request waited for the long one to end"
    t.join(120)
    assert long_done.is_set()
