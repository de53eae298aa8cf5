"""The llama-server half of bench/speculative.py: the same prompt token ids sent to llama.cpp's
server without and with each of its n-gram speculative types, beside turnkv's figures."""

from __future__ import annotations

import os

import httpx

from bench.replay_run import LlamaServer


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system, all its threads), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_type(args, gguf: str, spec_type: str, rows: dict) -> dict:
    """A fresh server with ``spec_type`` (``none``: no drafts), each workload's requests in
    order once: decode tok/s (the first token, sampled from the prompt's logits, not counted,
    as turnkv counts it), by wall time and by CPU time (the server process's CPU time over the
    request, the decode's share of it taken as its share of the server's own prompt + decode
    times), and drafted / accepted tokens."""
    flags = ["-c", "16384", "-np", "1", "-t", str(args.threads), "-tb", str(args.threads)]
    if spec_type != "none":
        flags += ["--spec-type", spec_type]
    server = LlamaServer(args.llama_server, gguf, flags)
    out = {}
    try:
        server.wait()
        base = server.url.removesuffix("/v1")
        for name, row in rows.items():
            decoded = ms = cpu = drafted = accepted = tokens = 0
            for ids, max_tokens in row["prompts"]:
                c0 = cpu_seconds(server.proc.pid)
                r = httpx.post(base + "/completion", json={"prompt": ids, "n_predict": max_tokens, "temperature": 0.0,
                                                          "cache_prompt": True, "stream": False}, timeout=1800)
                r.raise_for_status()
                t = r.json()["timings"]
                share = t["predicted_ms"] / max(t["predicted_ms"] + t["prompt_ms"], 1e-9)
                cpu += (cpu_seconds(server.proc.pid) - c0) * share
                decoded += max(0, t["predicted_n"] - 1)
                tokens += t["predicted_n"]
                ms += t["predicted_ms"]
                drafted += t.get("draft_n", 0)
                accepted += t.get("draft_n_accepted", 0)
            out[name] = {"tok_s": decoded / (ms / 1000) if ms else 0.0, "cpu_tok_s": decoded / max(cpu, 1e-9),
                         "drafted": drafted, "accepted": accepted, "tokens": tokens}
    finally:
        server.close()
    return out


def compare(args, gguf: str, rows: dict) -> None:
    peers = {}
    for spec_type in args.llama_types:
        peers[spec_type] = run_type(args, gguf, spec_type, rows)
        print(f"  llama-server {spec_type} done (load {os.getloadavg()[0]:.1f})", flush=True)
    for name, row in rows.items():
        print(f"  {name}: turnkv off {row['off']:.1f} / {row['mode']} {row['on']:.1f} tok/s ({row['tokens']} tok); "
              f"by CPU time {row['cpu_off']:.1f} / {row['cpu_on']:.1f}")
        for spec_type, got in peers.items():
            g = got[name]
            rate = f", accepted {g['accepted']}/{g['drafted']}" if g["drafted"] else ""
            over = g['tok_s'] / max(peers['none'][name]['tok_s'], 1e-9) if 'none' in peers else 0
            print(f"    llama-server {spec_type:<14} {g['tok_s']:6.1f} tok/s, by CPU {g['cpu_tok_s']:6.1f} "
                  f"({g['tokens']} tok{rate}), speedup over its none {over:.2f}x")
        best_type = max((t for t in peers if t != "none"), key=lambda t: peers[t][name]["tok_s"], default=None)
        if best_type is not None:
            best = peers[best_type][name]["tok_s"]
            cpu_type = max((t for t in peers if t != "none"), key=lambda t: peers[t][name]["cpu_tok_s"])
            cpu_best = peers[cpu_type][name]["cpu_tok_s"]
            print(f"    turnkv {row['mode']} / llama-server's best ({best_type}): {row['on'] / max(best, 1e-9):.2f}x; "
                  f"by CPU time ({cpu_type}): {row['cpu_on'] / max(cpu_best, 1e-9):.2f}x")
