// The ignis Monitor: reads /v1/ignis/state/stream (Server-Sent Events, one state a second) and
// draws each engine's section. Plain JS, no build step. The stream is read with fetch, not
// EventSource, so that it can carry the API key. The retained-state list is virtualised (only
// the rows in view are in the DOM), so 1,000 states stay cheap; a state whose tier changed flashes.
"use strict";

const RETRY_MS = 1000; // reconnect after the stream ends or fails
const ROW_HEIGHT = 24;
const HISTORY = 180; // samples kept per engine (3 minutes at 1 Hz)
const FLASH_MS = 2000;
const MAX_REMEMBERED = 5000; // names whose last tier is kept (for the flash)
const views = new Map(); // engine address -> view
let apiKey = sessionStorage.getItem("ignis-api-key") || "";
// /monitor?limit=N asks for the first N states per engine (the JSON's own bound is 1000).
const limit = new URLSearchParams(location.search).get("limit");
const streamUrl = "/v1/ignis/state/stream" + (limit ? `?limit=${encodeURIComponent(limit)}` : "");
let updates = 0;
let current = null; // the AbortController of the stream being read

const fmtInt = (n) => (n ?? 0).toLocaleString("en-US");
const fmtRate = (n) => (n ?? 0).toFixed(1);
function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
function fmtSeconds(s) {
  if (!s) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function setStatus(text, bad) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.classList.toggle("bad", !!bad);
}

const delay = (ms) => new Promise((done) => setTimeout(done, ms));

async function follow() {
  // Read the stream until it ends, then connect again; a 401 waits for the key instead.
  for (;;) {
    const control = (current = new AbortController());
    try {
      const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
      const reply = await fetch(streamUrl, { headers, cache: "no-store", signal: control.signal });
      if (reply.status === 401) {
        document.getElementById("keyform").hidden = false;
        setStatus("this gateway needs an API key", true);
        return; // the key form starts following again
      }
      if (!reply.ok) {
        const body = await reply.json().catch(() => null);
        setStatus(body?.error?.message || `HTTP ${reply.status}`, true);
      } else {
        await readEvents(reply.body);
      }
    } catch (err) {
      if (control.signal.aborted) return; // replaced by a newer stream
      setStatus(`cannot reach the gateway: ${err}`, true);
    }
    if (control.signal.aborted) return;
    await delay(RETRY_MS);
  }
}

async function readEvents(body) {
  // Server-Sent Events: frames end with a blank line; each `data:` line is one JSON state.
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) show(JSON.parse(data));
    }
  }
}

function show(body) {
  const started = performance.now();
  render(body);
  updates++;
  // For bench/monitor.py: how long drawing took, and when the first update was on screen.
  document.body.dataset.renderMs = (performance.now() - started).toFixed(3);
  if (updates === 1) document.body.dataset.firstRenderAt = performance.now().toFixed(3);
  document.body.dataset.updates = String(updates);
  setStatus(`updated ${new Date(body.time * 1000).toLocaleTimeString()}`);
}

function render(body) {
  const seen = new Set();
  for (const engine of body.engines) {
    seen.add(engine.address);
    let view = views.get(engine.address);
    if (!view) {
      view = makeView(engine.address);
      views.set(engine.address, view);
    }
    updateView(view, engine);
  }
  for (const [address, view] of views) {
    if (!seen.has(address)) { view.el.remove(); views.delete(address); }
  }
}

function makeView(address) {
  const el = document.getElementById("engine-template").content.firstElementChild.cloneNode(true);
  el.dataset.address = address;
  document.getElementById("engines").appendChild(el);
  const view = {
    el, states: [], lastTier: new Map(), flashUntil: new Map(), history: [],
    field: (name) => el.querySelector(`[data-field="${name}"]`),
    viewport: el.querySelector(".viewport"), rows: el.querySelector(".rows"), spacer: el.querySelector(".spacer"),
  };
  view.viewport.addEventListener("scroll", () => drawRows(view));
  return view;
}

function updateView(view, e) {
  const q = (s) => view.el.querySelector(s);
  q(".address").textContent = e.address;
  q(".model").textContent = e.model || "(engine)";
  const health = q(".health");
  health.textContent = e.healthy ? "serving" : "unavailable";
  health.className = `health ${e.healthy ? "ok" : "bad"}`;
  const error = q(".error");
  error.hidden = !e.error;
  error.textContent = e.error || "";
  if (e.error) return;
  const now = performance.now();
  view.history.push({ t: e.taken_at, counters: e.counters, store: e.tiers.store || null, engine: e.tiers.engine });
  if (view.history.length > HISTORY) view.history.shift();

  const p = e.pool;
  view.field("pool-used").textContent = fmtInt(p.used);
  view.field("pool-cached").textContent = fmtInt(p.cached);
  view.field("pool-free").textContent = fmtInt(p.free);
  view.field("pool-total").textContent = fmtInt(p.total);
  view.field("page-size").textContent = fmtInt(p.page_size);
  drawPool(q("canvas.pool"), p);

  const slots = [["live state slots", e.slots.state], ["retained, device", e.slots.retained_device],
    ["retained, host", e.slots.retained_host]].filter(([, s]) => s.total > 0);
  bars(view.field("slots"), slots.map(([label, s]) => [label, s.used, s.total, fmtInt]));
  view.field("run-i").textContent = e.sequences.running.interactive;
  view.field("run-a").textContent = e.sequences.running.agent;
  view.field("wait-i").textContent = e.sequences.waiting.interactive;
  view.field("wait-a").textContent = e.sequences.waiting.agent;
  view.field("prefill-rate").textContent = fmtRate(e.throughput.prefill_tokens_per_second);
  view.field("decode-rate").textContent = fmtRate(e.throughput.decode_tokens_per_second);

  const t = e.tiers;
  if (t.ram) {
    bars(view.field("tiers"), [["KV-RAM", t.ram.bytes_used, t.ram.bytes_total, fmtBytes],
      ["KV-disk", t.disk.bytes_used, t.disk.bytes_total, fmtBytes]]);
  } else {
    view.field("tiers").textContent = t.configured ? "tierstore not reachable" : "no tierstore configured";
  }
  const minute = perMinute(view.history, "store");
  const engineMinute = perMinute(view.history, "engine");
  view.field("engine-spm").textContent = engineMinute ? fmtInt(engineMinute.spills) : "–";
  view.field("engine-rpm").textContent = engineMinute ? fmtInt(engineMinute.restores) : "–";
  view.field("spm").textContent = minute ? fmtInt(minute.spills) : "–";
  view.field("rpm").textContent = minute ? fmtInt(minute.restores) : "–";
  view.field("epm").textContent = minute ? fmtInt(minute.evictions) : "–";
  view.field("checksum").textContent = t.store ? fmtInt(t.store.checksum_failures) : "–";

  const rates = hitRates(view.history);
  const latest = rates.length ? rates[rates.length - 1] : null;
  view.field("hitrate").textContent = latest == null ? "–" : `${(latest * 100).toFixed(0)} %`;
  drawHitRate(q("canvas.hitrate"), rates);

  // A state whose tiers changed since it was last seen flashes. A name can be in two tiers at
  // once (written ahead to KV-RAM while still on the device), so its set of tiers is compared.
  // The last set of each name is kept, bounded, so a state missing from one update still
  // flashes when it comes back elsewhere.
  const tiersOf = new Map();
  for (const s of e.states) tiersOf.set(s.name, [...(tiersOf.get(s.name) || []), s.tier]);
  for (const [name, list] of tiersOf) {
    const key = list.sort().join("+");
    const before = view.lastTier.get(name);
    if (before !== undefined && before !== key) view.flashUntil.set(name, now + FLASH_MS);
    view.lastTier.delete(name);
    view.lastTier.set(name, key);
  }
  while (view.lastTier.size > MAX_REMEMBERED) view.lastTier.delete(view.lastTier.keys().next().value);
  for (const [name, until] of view.flashUntil) if (until < now) view.flashUntil.delete(name);
  view.states = e.states;
  view.field("states-count").textContent = e.states_total > e.states.length
    ? `${fmtInt(e.states.length)} of ${fmtInt(e.states_total)}` : fmtInt(e.states_total);
  view.spacer.style.height = `${e.states.length * ROW_HEIGHT}px`;
  drawRows(view);
  drawRecent(q("table.recent tbody"), e.recent);
}

function bars(container, items) {
  container.replaceChildren(...items.map(([label, used, total, fmt]) => {
    const bar = document.createElement("div");
    bar.className = "bar";
    const pct = total ? Math.min(100, (100 * used) / total) : 0;
    bar.innerHTML = `<label><span></span><span></span></label><div class="track"><div class="fill"></div></div>`;
    bar.querySelector("label span").textContent = label;
    bar.querySelector("label span:last-child").textContent = `${fmt(used)} / ${fmt(total)}`;
    bar.querySelector(".fill").style.width = `${pct}%`;
    return bar;
  }));
}

function drawPool(canvas, p) {
  // One cell per page, up to 2048 cells (then each cell stands for several pages).
  const ctx = canvas.getContext("2d");
  const cells = Math.max(1, Math.min(p.total, 2048));
  const per = p.total / cells;
  const cols = Math.ceil(Math.sqrt(cells * (canvas.width / canvas.height)));
  const rows = Math.ceil(cells / cols);
  const w = canvas.width / cols, h = canvas.height / rows;
  const css = getComputedStyle(document.documentElement);
  const colors = [css.getPropertyValue("--used"), css.getPropertyValue("--cached"), css.getPropertyValue("--free")];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < cells; i++) {
    const page = i * per;
    ctx.fillStyle = page < p.used ? colors[0] : page < p.used + p.cached ? colors[1] : colors[2];
    ctx.fillRect((i % cols) * w, Math.floor(i / cols) * h, Math.max(w - 1, 1), Math.max(h - 1, 1));
  }
}

function perMinute(history, side) {
  // How many the store (or the engine) counted over the last minute (since the page opened, if less).
  const samples = history.filter((s) => s[side]);
  if (samples.length < 2) return null;
  const last = samples[samples.length - 1];
  const first = samples.find((s) => s.t >= last.t - 60) || samples[0];
  const count = (key) => (last[side][key] ?? 0) - (first[side][key] ?? 0);
  return { spills: count("spills"), restores: count("restores"), evictions: count("evictions") };
}

function hitRates(history) {
  // Per sample: reused / prompt tokens over the 30 s before it (null: no prompt in that window).
  const out = [];
  for (let i = 0; i < history.length; i++) {
    const cur = history[i];
    let j = i;
    while (j > 0 && history[j - 1].t >= cur.t - 30) j--;
    const base = j === i ? (i > 0 ? history[i - 1] : null) : history[j];
    const prompt = base ? cur.counters.prompt_tokens - base.counters.prompt_tokens : cur.counters.prompt_tokens;
    const reused = base ? cur.counters.reused_tokens - base.counters.reused_tokens : cur.counters.reused_tokens;
    out.push(prompt > 0 ? Math.min(1, reused / prompt) : null);
  }
  return out;
}

function drawHitRate(canvas, rates) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.strokeStyle = "#2a3039";
  for (const y of [0.25, 0.5, 0.75]) {
    ctx.beginPath(); ctx.moveTo(0, canvas.height * y); ctx.lineTo(canvas.width, canvas.height * y); ctx.stroke();
  }
  ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--ok");
  ctx.lineWidth = 2;
  ctx.beginPath();
  let drawing = false;
  const step = canvas.width / Math.max(HISTORY - 1, 1);
  const x0 = canvas.width - (rates.length - 1) * step;
  rates.forEach((r, i) => {
    if (r == null) { drawing = false; return; }
    const x = x0 + i * step, y = canvas.height - 4 - r * (canvas.height - 8);
    if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    drawing = true;
  });
  ctx.stroke();
}

const STATE_COLUMNS = [
  (s) => (s.rank ?? "–"), (s) => s.name, (s) => s.kind, (s) => s.tier, (s) => s.class, (s) => fmtInt(s.tokens),
  (s) => fmtBytes(s.bytes), (s) => fmtSeconds(s.age_seconds), (s) => fmtSeconds(s.idle_seconds), (s) => s.hits,
  (s) => (s.protected ? "protected" : ""),
];

function drawRows(view) {
  // Only the rows in view (and a few around) are in the DOM.
  const top = view.viewport.scrollTop;
  const first = Math.max(0, Math.floor(top / ROW_HEIGHT) - 5);
  const last = Math.min(view.states.length, Math.ceil((top + view.viewport.clientHeight) / ROW_HEIGHT) + 5);
  const now = performance.now();
  const rows = [];
  for (let i = first; i < last; i++) {
    const s = view.states[i];
    const row = document.createElement("div");
    row.className = `states-row state tier-${s.tier}`;
    if ((view.flashUntil.get(s.name) || 0) > now) row.classList.add("flash");
    row.dataset.name = s.name;
    row.dataset.tier = s.tier;
    row.dataset.kind = s.kind;
    row.dataset.rank = s.rank ?? "";
    STATE_COLUMNS.forEach((col, c) => {
      const cell = document.createElement("span");
      cell.textContent = String(col(s));
      if (c === 1) cell.className = "mono";
      if (c === 3) cell.className = "tier";
      row.appendChild(cell);
    });
    rows.push(row);
  }
  view.rows.style.transform = `translateY(${first * ROW_HEIGHT}px)`;
  view.rows.replaceChildren(...rows);
}

function drawRecent(tbody, recent) {
  const rows = recent.slice().reverse().map((r) => {
    const tr = document.createElement("tr");
    tr.className = "request";
    tr.dataset.requestId = r.request_id;
    tr.dataset.cached = String(r.cached_tokens);
    tr.dataset.tier = r.tier;
    for (const value of [new Date(r.finished_at * 1000).toLocaleTimeString(), r.request_id, r.class,
      fmtInt(r.prompt_tokens), fmtInt(r.cached_tokens), r.tier, r.kind, r.ttft_ms.toFixed(1),
      fmtInt(r.completion_tokens), r.finish_reason]) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    return tr;
  });
  tbody.replaceChildren(...rows);
}

document.getElementById("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("key").value.trim();
  sessionStorage.setItem("ignis-api-key", apiKey);
  document.getElementById("keyform").hidden = true;
  if (current) current.abort();
  follow();
});

follow();
