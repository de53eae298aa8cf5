// turnkv's chat page: streams /v1/chat/completions, keeps the conversation in memory and shows,
// per reply, what the server reused (usage.prompt_tokens_details.cached_tokens) and where the time
// went (the `timings` object turnkv adds to the last chunk). No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "turnkv-api-key";
const state = { history: [], busy: false, abort: null, turns: [] };

// ------------------------------------------------------------------ HTTP, with the API key
function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function askKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-input").value = "";
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      $("forget-key").hidden = !key;
      resolve(Boolean(key));
    }, { once: true });
    dialog.showModal();
  });
}

async function api(path, options = {}) {
  for (let attempt = 0; attempt < 3; attempt++) {
    const headers = Object.assign({}, options.headers || {});
    if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status !== 401) return response;
    sessionStorage.removeItem(KEY_STORAGE);
    if (!(await askKey())) return response;
  }
  throw new Error("the API key was refused");
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) { return response.status + " " + response.statusText; }
}

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

// ------------------------------------------------------------------ models and cache panel
async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) { showError(await errorText(response)); return; }
  const body = await response.json();
  const select = $("model");
  select.innerHTML = "";
  for (const m of body.data || []) {
    const option = document.createElement("option");
    option.value = option.textContent = m.id;
    select.appendChild(option);
  }
}

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function fillList(dl, rows) {
  dl.innerHTML = "";
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
}

async function refreshCache() {
  const response = await api("/v1/cache/stats");
  if (!response.ok) return;
  const s = await response.json();
  const lookups = s.lookups || 0;
  fillList($("cache-stats"), [
    ["enabled", s.prompt_cache_enabled ? "yes" : "no"],
    ["hit rate", lookups ? ((100 * (s.hits || 0)) / lookups).toFixed(0) + "% of " + lookups : "–"],
    ["tokens reused", s.tokens_reused ?? "–"],
    ["tokens prefilled", s.tokens_prefilled ?? "–"],
    ["entries", s.entries ?? "–"],
    ["bytes / budget", fmtBytes(s.bytes) + " / " + fmtBytes(s.budget_bytes)],
    ["evictions", s.evictions ?? "–"],
    ["running / waiting", (s.running ?? "–") + " / " + (s.waiting ?? "–")],
  ]);
  fillList($("cache-refusals"), Object.entries(s.refusals || {}).map(([k, v]) => [k, v]));
  const kinds = {};
  (s.layers || []).forEach((kind, i) => {
    const mode = (s.kv_cache_mode_effective || [])[i] || "";
    const key = kind + (mode ? " (" + mode + ")" : "");
    kinds[key] = (kinds[key] || 0) + 1;
  });
  fillList($("cache-kv"), Object.entries(kinds).map(([k, v]) => [k, v + " layers"]));
}

function drawChart() {
  const canvas = $("hit-chart"), ctx = canvas.getContext && canvas.getContext("2d");
  if (!ctx) return;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const turns = state.turns.slice(-26), w = canvas.width / 26, h = canvas.height - 14;
  ctx.font = "10px sans-serif";
  turns.forEach((t, i) => {
    const share = t.prompt ? t.cached / t.prompt : 0;
    ctx.fillStyle = "#d0d5dd"; ctx.fillRect(i * w + 1, 0, w - 2, h);
    ctx.fillStyle = "#12b76a"; ctx.fillRect(i * w + 1, h * (1 - share), w - 2, h * share);
  });
  ctx.fillStyle = "#4b5563";
  ctx.fillText("reused share of each prompt (green)", 2, canvas.height - 2);
}

// ------------------------------------------------------------------ messages
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function showStats(div, usage, timings, clientTtft) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const cached = usage ? (usage.prompt_tokens_details || {}).cached_tokens || 0 : 0;
  const items = [];
  if (usage) {
    items.push(["prompt", usage.prompt_tokens + " tok"]);
    items.push(["cached", cached + " tok (" + (usage.prompt_tokens ? Math.round(100 * cached / usage.prompt_tokens) : 0) + "%)", "reused"]);
    items.push(["completion", usage.completion_tokens + " tok"]);
  }
  if (timings) {
    items.push(["prefill", timings.prefill_ms.toFixed(0) + " ms (" + timings.prefilled_tokens + " tok)"]);
    items.push(["TTFT", timings.ttft_ms.toFixed(0) + " ms"]);
    items.push(["decode", timings.decode_tokens_per_s.toFixed(1) + " tok/s"]);
    // tokens a decode step: each step samples one token and keeps the draft tokens it verified
    // (docs/speculative.md); the first token comes from the prefill
    const decoded = usage ? usage.completion_tokens - 1 : 0, accepted = timings.accepted_tokens || 0;
    if (decoded > 0 && decoded > accepted) {
      const drafts = timings.drafted_tokens ? ", drafts " + accepted + "/" + timings.drafted_tokens + " taken" : "";
      items.push(["speculative " + timings.speculative, (decoded / (decoded - accepted)).toFixed(2) + " tok/step" + drafts]);
    }
  } else if (clientTtft != null) {
    items.push(["TTFT (client)", clientTtft.toFixed(0) + " ms"]);
  }
  for (const [label, value, cls] of items) {
    const span = document.createElement("span");
    if (cls) span.className = cls;
    span.textContent = label + " " + value;
    stats.appendChild(span);
  }
  div.appendChild(stats);
  if (usage) { state.turns.push({ prompt: usage.prompt_tokens, cached }); drawChart(); }
}

// ------------------------------------------------------------------ one turn, streamed
async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 256,
    temperature: parseFloat($("temperature").value) || 0,
  };
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".body");
  let reply = "", usage = null, timings = null, finish = null, clientTtft = null;
  const t0 = performance.now();
  state.abort = new AbortController();
  setBusy(true);
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.abort.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          if (chunk.timings) timings = chunk.timings;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              if (clientTtft == null) clientTtft = performance.now() - t0;
              reply += piece;
              out.textContent = reply;
              div.scrollIntoView({ block: "end" });
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
    // the reply goes back exactly as generated: the next prompt then extends this one
    state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
    showStats(div, usage, timings, clientTtft);
    if (finish === "length") div.querySelector(".stats").append(" [cut at max tokens]");
  } catch (err) {
    if (err.name === "AbortError") {
      state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
      out.textContent = reply + " [stopped]";
    } else {
      div.remove();
      showError(String(err.message || err));
    }
  } finally {
    setBusy(false);
    state.abort = null;
    refreshCache().catch(() => {});
  }
}

function setBusy(busy) {
  state.busy = busy;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ------------------------------------------------------------------ wiring
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.busy) return;
  $("input").value = "";
  showError("");
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("new-chat").addEventListener("click", () => {
  if (state.busy) return;
  state.history = [];
  $("messages").innerHTML = "";
  showError("");
});
$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  $("forget-key").hidden = true;
});
$("forget-key").hidden = !apiKey();

loadModels().then(refreshCache).catch((err) => showError(String(err.message || err)));
