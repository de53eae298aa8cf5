"""The llama-server half of bench/speculative.py: the same prompt token ids sent to llama.cpp's
server without and with each of its n-gram speculative types, beside turnkv's figures."""

from __future__ import annotations

import os

import httpx

from bench.replay_run import LlamaServer


def run_type(args, gguf: str, spec_type: str, rows: dict) -> dict:
    """A fresh server with ``spec_type`` (``none``: no drafts), each workload's requests in
    order once: decode tok/s (the first token, sampled from the prompt's logits, not counted,
    as turnkv counts it) and drafted / accepted tokens."""
    flags = ["-c", "16384", "-np", "1", "-t", str(args.threads), "-tb", str(args.threads)]
    if spec_type != "none":
        flags += ["--spec-type", spec_type]
    server = LlamaServer(args.llama_server, gguf, flags)
    out = {}
    try:
        server.wait()
        base = server.url.removesuffix("/v1")
        for name, row in rows.items():
            decoded = ms = drafted = accepted = tokens = 0
            for ids, max_tokens in row["prompts"]:
                r = httpx.post(base + "/completion", json={"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                                                          "cache_prompt": True, "stream": False}, timeout=1800)
                r.raise_for_status()
                t = r.json()["timings"]
                decoded += max(0, t["predicted_n"] - 1)
                tokens += t["predicted_n"]
                ms += t["predicted_ms"]
                drafted += t.get("draft_n", 0)
                accepted += t.get("draft_n_accepted", 0)
            out[name] = {"tok_s": decoded / (ms / 1000) if ms else 0.0, "drafted": drafted, "accepted": accepted,
                         "tokens": tokens}
    finally:
        server.close()
    return out


def compare(args, gguf: str, rows: dict) -> None:
    peers = {}
    for spec_type in args.llama_types:
        peers[spec_type] = run_type(args, gguf, spec_type, rows)
        print(f"  llama-server {spec_type} done (load {os.getloadavg()[0]:.1f})", flush=True)
    for name, row in rows.items():
        print(f"  {name}: turnkv off {row['off']:.1f} / ngram {row['ngram']:.1f} tok/s ({row['tokens']} tok)")
        for spec_type, got in peers.items():
            g = got[name]
            rate = f", accepted {g['accepted']}/{g['drafted']}" if g["drafted"] else ""
            print(f"    llama-server {spec_type:<14} {g['tok_s']:6.1f} tok/s ({g['tokens']} tok{rate}), "
                  f"speedup over its none {g['tok_s'] / max(peers['none'][name]['tok_s'], 1e-9) if 'none' in peers else 0:.2f}x")
        best_type = max((t for t in peers if t != "none"), key=lambda t: peers[t][name]["tok_s"], default=None)
        if best_type is not None:
            best = peers[best_type][name]["tok_s"]
            print(f"    turnkv ngram / llama-server's best ({best_type}): {row['ngram'] / max(best, 1e-9):.2f}x")
