"""The replay half of bench/agent_replay.py: recorded sessions sent to one server at a time, with
think time between steps, and the figures that compare servers."""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import httpx

from bench.multiuser import ServerProcess, free_port


def load_trace(path: Path) -> OrderedDict[str, list[dict]]:
    """session -> its recorded requests in step order."""
    sessions: OrderedDict[str, list[dict]] = OrderedDict()
    for line in path.read_text().splitlines():
        row = json.loads(line)
        sessions.setdefault(row["session"], []).append(row)
    for rows in sessions.values():
        rows.sort(key=lambda r: r["step"])
    return sessions


def new_tokens(row: dict, model: str = "gemma3-270m", template: str = "chatml-tools") -> dict:
    """A recorded chat request rendered as turnkv renders it: its prompt tokens, how many of them
    the previous request's prompt and reply (every message up to the last assistant turn) already
    held, and the last tool result's own tokens."""
    from turnkv.server import tools as toolkit
    from turnkv.server.schemas import ChatCompletionRequest

    tok = _tokenizer(model, template)
    req = ChatCompletionRequest.model_validate(row["body"])
    messages = [toolkit.history_message(m) for m in req.template_messages()]
    tools = toolkit.validate_tools(req.tools) if req.tools else None
    prompt = tok.render_chat(messages, True, boundary_messages=0, tools=tools).ids
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    seen = tok.render_chat(messages[:last + 1], False, boundary_messages=0, tools=tools).ids
    same = next((i for i, (a, b) in enumerate(zip(prompt, seen)) if a != b), min(len(prompt), len(seen)))
    result = messages[-1]["content"] if messages[-1]["role"] == "tool" else ""
    return {"session": row["session"], "step": row["step"], "prompt": len(prompt), "seen": same,
            "new": len(prompt) - same, "result": len(tok.encode(result, add_special_tokens=False)) if result else 0}


_TOKENIZERS: dict = {}


def _tokenizer(model: str, template: str):
    if (model, template) not in _TOKENIZERS:
        from turnkv.loading import load_tokenizer
        from turnkv.loading.tokenizer import chat_template_source
        _TOKENIZERS[model, template] = load_tokenizer(model).with_template(chat_template_source(template))
    return _TOKENIZERS[model, template]


class LlamaServer(ServerProcess):
    """llama.cpp's or ik_llama.cpp's llama-server on one GGUF, in a subprocess for one run."""

    name = "llama-server"

    def __init__(self, binary: str, gguf: str, flags: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-bench-", suffix=".log", delete=False)
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        # run in the temp folder: the servers may drop a llama.log where they start
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
        self.url = f"http://127.0.0.1:{self.port}/v1"


def _cached(chunk: dict) -> int | None:
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    timings = chunk.get("timings") or {}
    return int(timings["cache_n"]) if "cache_n" in timings else None


def _server_first(t: dict | None) -> float | None:
    """The server's own time to the first token: turnkv's render + tokenize + queue + ttft (from
    submit), llama.cpp's prompt_ms (prompt processing; its first token follows at once)."""
    if not t:
        return None
    if "ttft_ms" in t:
        return sum(t.get(k, 0) for k in ("render_ms", "tokenize_ms", "queue_ms", "ttft_ms"))
    return t.get("prompt_ms")


def send(url: str, row: dict) -> dict:
    """One recorded request, body as recorded; the step's figures."""
    t0 = time.perf_counter()
    first = None
    prompt = cached = server_first = None
    with httpx.stream("POST", url.removesuffix("/v1") + row["endpoint"], json=row["body"], timeout=1800,
                      headers={"Authorization": "Bearer none"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{row['session']} step {row['step']}: HTTP {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if first is None and (delta.get("content") or delta.get("tool_calls")
                                      or delta.get("reasoning_content")):
                    first = time.perf_counter()
            if chunk.get("usage"):
                prompt = chunk["usage"].get("prompt_tokens", prompt)
            c = _cached(chunk)
            cached = c if c is not None else cached
            server_first = _server_first(chunk.get("timings")) or server_first
    end = time.perf_counter()
    return {"step": row["step"], "ttft_ms": ((first or end) - t0) * 1000, "total_ms": (end - t0) * 1000,
            "prompt_tokens": prompt, "cached_tokens": cached, "server_first_ms": server_first}


def play(url: str, rows: list[dict], think: float, out: list, start: threading.Barrier | None) -> None:
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    steps = []
    for i, row in enumerate(rows):
        if i:
            time.sleep(think)
        steps.append(send(url, row))
    out.append({"session": rows[0]["session"], "wall_s": time.perf_counter() - t0, "steps": steps})


def run_sessions(url: str, groups: list[list[dict]], think: float) -> list[dict]:
    out: list[dict] = []
    barrier = threading.Barrier(len(groups)) if len(groups) > 1 else None
    threads = [threading.Thread(target=play, args=(url, rows, think, out, barrier)) for rows in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out, key=lambda s: s["session"])


def run_target(name: str, start, sessions, think: float, concurrent: int, steps: int, single: int) -> dict:
    """1 session alone (the first of each framework, ``single`` frameworks at most), then
    ``concurrent`` sessions at once; a fresh server per run."""
    cut = [rows[:steps] if steps else rows for rows in sessions.values()]
    firsts = {}
    for rows in cut:
        firsts.setdefault(rows[0]["framework"], rows)
    runs = {f"1 session ({fw})": [rows] for fw, rows in list(firsts.items())[:single]}
    runs[f"{concurrent} sessions"] = cut[:concurrent]
    out = {}
    for label, groups in runs.items():
        server = start()
        try:
            server.wait()
            t0 = time.perf_counter()
            out[label] = run_sessions(server.url, groups, think)
            print(f"{name}: {label} done in {time.perf_counter() - t0:.1f} s", flush=True)
            cache = cache_figures(server.url)
            if cache:
                out[label + " cache"] = cache
                print(f"{name}: {label} cache: {json.dumps(cache)}", flush=True)
        finally:
            server.close()
    return out


def cache_figures(url: str) -> dict | None:
    """turnkv's session figures after a run: resumes by source, evictions, the disk tier's hits."""
    try:
        r = httpx.get(url.removesuffix("/v1") + "/v1/cache/stats", timeout=30)
        stats = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    if "resumes" not in stats:
        return None
    out = {k: stats.get(k) for k in ("resumes", "evictions", "head_evictions", "bytes", "budget_bytes")}
    tiers = stats.get("tiers") or {}
    if "disk" in tiers:
        out["disk"] = {k: tiers["disk"].get(k) for k in ("hits", "tokens_reused", "writes", "entries", "bytes")}
        out["write_behind"] = tiers.get("write_behind")
    return out


def summary(sessions: list[dict]) -> dict:
    later = [s for sess in sessions for s in sess["steps"][1:]]
    shares = [s["cached_tokens"] / s["prompt_tokens"] for s in later
              if s["cached_tokens"] is not None and s["prompt_tokens"]]
    cached = sum(s["cached_tokens"] or 0 for s in later)
    prompt = sum(s["prompt_tokens"] or 0 for s in later)
    firsts = [s["server_first_ms"] for s in later if s["server_first_ms"] is not None]
    return {"ttft_med": statistics.median(s["ttft_ms"] for s in later),
            "server_first_med": statistics.median(firsts) if firsts else None,
            "ttft_p95": sorted(s["ttft_ms"] for s in later)[int(0.95 * (len(later) - 1))],
            "first_ttft": statistics.median(sess["steps"][0]["ttft_ms"] for sess in sessions),
            "step_med": statistics.median(s["total_ms"] for s in later),
            "reuse": cached / prompt if prompt else None, "reuse_min": min(shares) if shares else None,
            "wall": statistics.median(sess["wall_s"] for sess in sessions),
            "last_prompt": max(sess["steps"][-1]["prompt_tokens"] or 0 for sess in sessions),
            "steps": sum(len(sess["steps"]) for sess in sessions)}


def _fmt(v, spec=".0f") -> str:
    return "-" if v is None else format(v, spec)


def report(results: dict, json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    names = list(results)
    labels = list(dict.fromkeys(label for r in results.values() for label in r if not label.endswith(" cache")))
    for label in labels:
        print(f"\n== {label} ==")
        print(f"{'server':14} {'steps':>5} {'TTFT med':>9} {'p95':>7} {'srv 1st':>7} {'step 1':>7} {'step med':>8} "
              f"{'reuse':>6} {'min':>5} {'wall s':>7} {'last prompt':>11}")
        sums = {n: summary(results[n][label]) for n in names if label in results[n]}
        for n, s in sums.items():
            print(f"{n:14} {s['steps']:>5} {_fmt(s['ttft_med']):>9} {_fmt(s['ttft_p95']):>7} "
                  f"{_fmt(s['server_first_med']):>7} {_fmt(s['first_ttft']):>7} {_fmt(s['step_med']):>8} {_fmt(s['reuse'], '.3f'):>6} "
                  f"{_fmt(s['reuse_min'], '.2f'):>5} {_fmt(s['wall'], '.1f'):>7} {s['last_prompt']:>11}")
        base = sums.get("turnkv")
        for n, s in sums.items():
            if base is None or n == "turnkv":
                continue
            srv = (f"server first token {base['server_first_med'] / s['server_first_med']:.2f}x, "
                   if base["server_first_med"] and s["server_first_med"] else "")
            print(f"turnkv / {n}: TTFT median {base['ttft_med'] / s['ttft_med']:.2f}x, {srv}"
                  f"step median {base['step_med'] / s['step_med']:.2f}x, session wall {base['wall'] / s['wall']:.2f}x")
