// mlxd dashboard: the budget, every model's state, and the journal as a timeline.
// Plain JavaScript, no build step, no third-party code. It reads only the public
// routes (/admin/status, /admin/events, /admin/history, /admin/plan, /admin/whoami,
// /health) and, with an admin key, posts to /admin/models/{id}/load|unload.
"use strict";

(() => {
  const KEY_STORE = "mlxd.apiKey"; // sessionStorage: kept for this browser tab only
  const STATES = ["unloaded", "loading", "loaded", "draining", "unloading", "failed"];
  const HOLDS_BUDGET = new Set(["loading", "loaded", "draining", "unloading"]);
  const MARKED = new Set(["evicted", "preempted"]);
  const LANE_H = 26;
  const LEASE_H = 10;
  const LABEL_W = 110;

  const view = {
    status: null,
    scopes: null,
    range: 3600,
    transitions: new Map(), // seq -> transition row (journal columns)
    leases: new Map(), // lease id -> {model, acquired_at}
    progress: new Map(), // model -> latest load_progress event
    lastEventId: null,
    seen: [], // seqs delivered by the event stream, in order (for tests)
    streamCtrl: null,
    streamPaused: false,
    statusTimer: null,
  };

  const $ = (id) => document.getElementById(id);
  const el = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  };
  const svg = (tag, attrs = {}, ...children) => {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // ---- formatting (the same units as mlxd.units.format_bytes) ----------------------

  function formatBytes(n) {
    if (n === null || n === undefined) return "-";
    const a = Math.abs(n);
    if (a >= 1024 ** 3) return (n / 1024 ** 3).toFixed(2) + " GiB";
    if (a >= 1024 ** 2) return (n / 1024 ** 2).toFixed(1) + " MiB";
    if (a >= 1024) return (n / 1024).toFixed(1) + " KiB";
    return Math.round(n) + " B";
  }
  function ago(at) {
    if (!at) return "never";
    const s = Math.max(0, Date.now() / 1000 - at);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " d ago";
  }
  function clock(at, withSeconds) {
    const d = new Date(at * 1000);
    const opts = { hour: "2-digit", minute: "2-digit" };
    if (withSeconds) opts.second = "2-digit";
    return d.toLocaleTimeString([], opts);
  }
  // Distinct colours by the model's place in the config (stable while the config is).
  const PALETTE = [210, 28, 280, 185, 330, 50, 250, 10, 300, 230];
  function modelColor(name, light) {
    const names = view.status ? Object.keys(view.status.models) : [];
    const i = Math.max(0, names.indexOf(name));
    const h = PALETTE[i % PALETTE.length] + 17 * Math.floor(i / PALETTE.length);
    return `hsl(${h % 360}, 60%, ${light || 45}%)`;
  }

  // ---- the API, with the tab's key ------------------------------------------------

  class HttpError extends Error {
    constructor(status, body) {
      const msg = body && body.error ? body.error.message : `HTTP ${status}`;
      super(msg);
      this.status = status;
      this.code = body && body.error ? body.error.code : null;
    }
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra || {});
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  }

  async function api(path, options) {
    const opts = Object.assign({ cache: "no-store" }, options || {});
    opts.headers = authHeaders(opts.headers);
    const resp = await fetch(path, opts);
    const text = await resp.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    if (resp.status === 401) { askForKey("The daemon did not accept this key."); }
    if (!resp.ok) throw new HttpError(resp.status, body);
    return body;
  }

  function askForKey(message) {
    $("main").hidden = true;
    $("key-form").hidden = false;
    const err = $("key-error");
    err.hidden = !sessionStorage.getItem(KEY_STORE);
    err.textContent = message || "";
    stopStream();
  }

  // ---- status, models and the budget bar -------------------------------------------

  function can(scope) {
    return view.scopes === null || view.scopes.includes(scope);
  }

  async function refreshStatus() {
    const [status, health] = await Promise.all([api("/admin/status"), api("/health").catch(() => null)]);
    view.status = status;
    renderHeader(status, health);
    renderBudget(status);
    renderModels(status);
    renderTimeline();
  }

  function scheduleStatus(delayMs) {
    if (view.statusTimer !== null) return;
    view.statusTimer = setTimeout(async () => {
      view.statusTimer = null;
      try { await refreshStatus(); } catch (e) { showError(e); }
    }, delayMs);
  }

  function renderHeader(status, health) {
    const h = $("health");
    const level = health ? health.status : "unknown";
    h.textContent = level;
    h.className = "pill " + (level === "ok" ? "ok" : level === "degraded" ? "degraded" : "down");
    h.title = health && health.reasons && health.reasons.length ? health.reasons.join("\n") : "GET /health";
    $("meta").textContent = `v${status.version} · up ${ago(Date.now() / 1000 - status.uptime_s).replace(" ago", "")} · ${status.policy.strategy}`;
  }

  function memoryParts(m) {
    if (m.memory && typeof m.memory === "object") {
      return [["weights", m.memory.weights || 0], ["kv cache", m.memory.kv_cache || 0],
        ["prompt cache", m.memory.prompt_cache || 0]];
    }
    return [["weights", m.memory_bytes || 0]];
  }

  function renderBudget(status) {
    const bar = $("budget-bar");
    const legend = $("budget-legend");
    bar.replaceChildren();
    legend.replaceChildren();
    const budget = status.budget_bytes || 1;
    for (const [name, m] of Object.entries(status.models)) {
      if (!HOLDS_BUDGET.has(m.state)) continue;
      memoryParts(m).forEach(([part, bytes], i) => {
        if (!bytes) return;
        const seg = el("div", { class: "seg", title: `${name} ${part}: ${formatBytes(bytes)} (${m.state})`,
          "data-model": name, "data-part": part });
        seg.style.width = (100 * bytes / budget).toFixed(3) + "%";
        seg.style.background = modelColor(name, 42 + i * 14);
        if (m.state !== "loaded") seg.style.opacity = "0.6";
        bar.append(seg);
      });
      legend.append(el("li", {}, swatch(modelColor(name)), `${name} ${formatBytes(m.memory_bytes)} (${m.state})`));
    }
    const pct = (100 * status.committed_bytes / budget).toFixed(1);
    $("budget-text").textContent =
      `${formatBytes(status.committed_bytes)} committed of ${formatBytes(status.budget_bytes)} (${pct}%)`;
    const disk = status.prompt_cache_disk;
    $("disk-tier").textContent = !disk ? "" : disk.enabled
      ? `prompt cache on disk: ${formatBytes(disk.bytes)} of ${formatBytes(disk.max_bytes)} (${disk.entries} entries)`
      : "prompt cache on disk: off";
  }

  function swatch(color) {
    const s = el("span", { class: "swatch" });
    s.style.background = color;
    return s;
  }

  function stateCell(name, m) {
    const cell = el("td", { title: "state" }, el("span", { class: "state " + m.state, "data-state": m.state }, m.state));
    const p = view.progress.get(name);
    if (m.state === "loading" && p) {
      // the percent and eta come from the model's last measured load; a first load shows its seconds
      const known = p.percent !== undefined && p.percent !== null;
      const eta = p.eta_s !== undefined && p.eta_s !== null ? ` eta ${Number(p.eta_s).toFixed(1)}s` : "";
      const text = known ? `${Math.round(p.percent)}%${eta}` : `${Number(p.elapsed_s).toFixed(1)}s`;
      cell.append(el("span", { class: "progress", title: "load progress (load_progress events)" }, text));
    }
    return cell;
  }

  function actionCell(name, m) {
    const cell = el("td", { class: "actions" });
    if (!can("admin")) return cell;
    const busy = m.state === "loading" || m.state === "unloading";
    cell.append(
      el("button", { "data-action": "load", disabled: m.state === "loaded" || busy,
        onclick: () => act(name, "load") }, "load"),
      el("button", { "data-action": "unload", disabled: m.state === "unloaded" || busy,
        onclick: () => act(name, "unload") }, "unload"),
      el("button", { class: "danger", "data-action": "preempt", title: "unload now, preempting running requests",
        disabled: !(m.state === "loaded" || m.state === "draining"), onclick: () => act(name, "preempt") }, "preempt"),
    );
    if (can("read")) {
      cell.append(el("button", { "data-action": "plan", onclick: () => showPlan(name),
        title: "what would loading this model do now?" }, "plan"));
    }
    return cell;
  }

  function renderModels(status) {
    const body = $("models").tBodies[0];
    body.replaceChildren();
    for (const [name, m] of Object.entries(status.models)) {
      const cells = [
        ["", el("span", {}, swatch(modelColor(name)), " ", name)],
        ["state", stateCell(name, m)],
        ["memory", formatBytes(m.memory_bytes)],
        ["pin", m.pinned ? "pinned" : ""],
        ["priority", m.priority === undefined ? "" : String(m.priority)],
        ["leases", String(m.active_leases)],
        ["waiters", String(m.waiters)],
        ["last used", ago(m.last_used_at)],
      ];
      const row = el("tr", { "data-model": name });
      for (const [label, content] of cells) {
        const td = content instanceof HTMLTableCellElement ? content : el("td", {}, content);
        if (label) td.dataset.label = label;
        if (content === "") td.className = "blank";
        row.append(td);
      }
      row.append(el("td", { class: "err" }, m.last_error || ""), actionCell(name, m));
      body.append(row);
    }
    document.querySelector("th.actions-col").hidden = !can("admin");
  }

  async function act(name, what) {
    const path = what === "load" ? `/admin/models/${encodeURIComponent(name)}/load`
      : `/admin/models/${encodeURIComponent(name)}/unload${what === "preempt" ? "?preempt=true" : ""}`;
    $("action-error").hidden = true;
    try {
      await api(path, { method: "POST" });
    } catch (e) {
      showError(e);
    }
    scheduleStatus(0);
  }

  async function showPlan(name) {
    const box = $("plan");
    box.hidden = false;
    box.replaceChildren(el("span", { class: "muted" }, `planning ${name}…`));
    try {
      const plan = await api(`/admin/plan?model=${encodeURIComponent(name)}`);
      const title = el("div", {}, el("strong", {}, `Loading ${plan.model} now: ${plan.action.replaceAll("_", " ")}`));
      const bits = [];
      if (plan.committed_after !== undefined && plan.committed_after !== null) {
        bits.push(`committed after: ${formatBytes(plan.committed_after)}`);
      }
      if (plan.eta_s !== undefined && plan.eta_s !== null) bits.push(`eta ${Number(plan.eta_s).toFixed(1)} s`);
      if (plan.error) bits.push(`error: ${plan.error.code}`);
      box.replaceChildren(title, el("div", { class: "muted" }, bits.join(" · ")));
      if (plan.victims && plan.victims.length) {
        box.append(el("ul", {}, ...plan.victims.map((v) =>
          el("li", {}, `${v.model} (${v.state}, ${formatBytes(v.bytes)}): ${v.why}`))));
      }
    } catch (e) {
      box.replaceChildren(el("span", { class: "error" }, e.status === 404
        ? "this daemon has no /admin/plan route" : `plan failed: ${e.message}`));
    }
  }

  function showError(e) {
    if (e instanceof HttpError && e.status === 401) return;
    const p = $("action-error");
    p.hidden = false;
    p.textContent = e.message;
  }

  // ---- the timeline ------------------------------------------------------------------

  async function loadHistory() {
    const since = `${Math.ceil(view.range / 60)}m`;
    const [transitions, leases] = await Promise.all([
      api(`/admin/history?kind=transitions&since=${since}&limit=10000`),
      api(`/admin/history?kind=leases&since=${since}&limit=10000`),
    ]);
    view.transitions.clear();
    for (const t of transitions) view.transitions.set(t.seq, t);
    view.leases.clear();
    for (const l of leases) view.leases.set(l.id, { model: l.model, acquired_at: l.acquired_at });
  }

  // The lanes draw only what the journal knows: from the start of this run (now - uptime), or
  // from the window's first transition when it is older (an earlier run's); before that, nothing
  // (the daemon may not have been running: that time is not "unloaded").
  function spansOf(model, rows, t0, t1, current, runStart) {
    const spans = [];
    let state = rows.length ? rows[0].from_state : current;
    let start = Math.max(t0, rows.length ? Math.min(rows[0].at, runStart) : runStart);
    for (const r of rows) {
      const at = Math.max(t0, r.at);
      if (at > start) spans.push({ state, from: start, to: at });
      state = r.to_state;
      start = at;
    }
    if (t1 > start) spans.push({ state, from: start, to: t1 });
    return spans;
  }

  function renderTimeline() {
    const box = $("timeline");
    const status = view.status;
    if (!status) return;
    const names = Object.keys(status.models);
    const width = Math.max(320, box.clientWidth || 800);
    const t1 = Date.now() / 1000;
    const t0 = t1 - view.range;
    const labelW = width < 500 ? 48 : LABEL_W;
    const x = (t) => labelW + (width - labelW - 8) * (t - t0) / view.range;
    const laneH = LANE_H + LEASE_H + 8;
    const height = 22 + names.length * laneH;
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, height, role: "img",
      "aria-label": "residency timeline" });
    const ticks = Math.max(2, Math.min(8, Math.floor((width - labelW) / 110)));
    for (let i = 0; i <= ticks; i++) {
      const t = t0 + i * view.range / ticks;
      root.append(svg("line", { class: "gridline", x1: x(t), x2: x(t), y1: 14, y2: height }));
      root.append(svg("text", { class: "axis", x: x(t), y: 10, "text-anchor": i === 0 ? "start" : i === ticks ? "end" : "middle" },
        clock(t, view.range <= 300)));
    }
    const byModel = new Map(names.map((n) => [n, []]));
    for (const t of [...view.transitions.values()].sort((a, b) => a.seq - b.seq)) {
      if (byModel.has(t.model) && t.at >= t0) byModel.get(t.model).push(t);
    }
    names.forEach((name, i) => {
      const y = 18 + i * laneH;
      const lane = svg("g", { "data-model": name, class: "lane" });
      lane.append(svg("text", { class: "lane-label", x: 0, y: y + LANE_H * 0.68 }, name));
      for (const s of spansOf(name, byModel.get(name), t0, t1, status.models[name].state, t1 - status.uptime_s)) {
        const rect = svg("rect", { class: "span " + s.state, "data-state": s.state, x: x(s.from), y,
          width: Math.max(0.5, x(s.to) - x(s.from)), height: LANE_H });
        rect.append(svg("title", {}, `${name}: ${s.state} ${clock(s.from, true)}–${clock(s.to, true)}`));
        lane.append(rect);
      }
      for (const t of exitMarkers(byModel.get(name))) {
        const cx = x(t.at);
        const m = svg("path", { class: "marker " + t.reason, "data-reason": t.reason, "data-seq": t.seq,
          d: `M${cx - 6},${y - 1} L${cx + 6},${y - 1} L${cx},${y + 10} Z` });
        m.append(svg("title", {}, `${t.reason} at ${clock(t.at, true)}: ${t.from_state} → ${t.to_state}`));
        lane.append(m);
      }
      lane.append(...leaseBars(name, t0, x, y + LANE_H + 2));
      root.append(lane);
    });
    box.replaceChildren(root);
    renderRecent(t0);
  }

  // The transitions that start an eviction or a preemption (not every row of the way out):
  // loaded -> draining|unloading with reason evicted/preempted, and a drain that turns
  // into a preemption (draining -> unloading, preempted).
  function exitMarkers(rows) {
    const out = [];
    let marked = null;
    for (const t of rows) {
      if (t.from_state === "loaded" && (t.to_state === "draining" || t.to_state === "unloading")) {
        marked = MARKED.has(t.reason) ? t.reason : null;
        if (marked) out.push(t);
      } else if (t.from_state === "draining" && t.reason === "preempted" && marked !== "preempted") {
        marked = "preempted";
        out.push(t);
      }
    }
    return out;
  }

  function leaseBars(name, t0, x, y) {
    // one minute per bar (a second when zoomed to a minute; 60 bars beyond an hour)
    const bucket = view.range <= 60 ? 1 : view.range <= 3600 ? 60 : view.range / 60;
    const counts = new Map();
    for (const l of view.leases.values()) {
      if (l.model !== name || l.acquired_at < t0) continue;
      const b = Math.floor((l.acquired_at - t0) / bucket);
      counts.set(b, (counts.get(b) || 0) + 1);
    }
    const max = Math.max(1, ...counts.values());
    const bars = [];
    for (const [b, n] of counts) {
      const from = t0 + b * bucket;
      const h = Math.max(1.5, LEASE_H * n / max);
      const r = svg("rect", { class: "leases", x: x(from), y: y + LEASE_H - h,
        width: Math.max(1, x(from + bucket) - x(from) - 1), height: h });
      r.append(svg("title", {}, `${name}: ${n} lease${n === 1 ? "" : "s"} from ${clock(from, bucket < 60)}`));
      bars.push(r);
    }
    return bars;
  }

  function renderRecent(t0) {
    const list = $("recent");
    const rows = [...view.transitions.values()].filter((t) => t.at >= t0).sort((a, b) => a.seq - b.seq);
    const byModel = new Map();
    for (const t of rows) byModel.set(t.model, [...(byModel.get(t.model) || []), t]);
    const marked = [...byModel.values()].flatMap(exitMarkers).sort((a, b) => b.seq - a.seq).slice(0, 8);
    list.replaceChildren(...marked.map((t) => el("li", { "data-seq": t.seq },
      `${clock(t.at, true)} ${t.model}: ${t.reason} (${t.from_state} → ${t.to_state})`)));
  }

  function renderStateLegend() {
    const legend = $("state-legend");
    legend.replaceChildren(...STATES.map((s) => el("li", {}, el("span", { class: "swatch state " + s }), s)));
    legend.append(el("li", {}, el("span", { class: "swatch leases-swatch" }), "leases started (per bar)"));
  }

  // ---- live events (fetch-based SSE, so the key can go in a header) -------------------

  function onEvent(id, type, data) {
    if (id !== null) {
      view.lastEventId = id;
      view.seen.push(Number(id));
    }
    if (type === "transition") {
      view.transitions.set(Number(id), Object.assign({ seq: Number(id) }, data));
      view.progress.delete(data.model);
      scheduleStatus(150);
    } else if (type === "lease_acquired") {
      view.leases.set(data.lease_id, { model: data.model, acquired_at: data.at });
      scheduleStatus(400);
    } else if (type === "lease_released") {
      scheduleStatus(400);
    } else if (type === "load_progress") {
      view.progress.set(data.model, data);
      if (view.status) renderModels(view.status);
    } else if (type === "gap") {
      loadHistory().then(renderTimeline, showError);
    }
  }

  function parseBlock(block) {
    let id = null;
    let type = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
      if (field === "id") id = value;
      else if (field === "event") type = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return;
    let payload = null;
    try { payload = JSON.parse(data.join("\n")); } catch (_) { return; }
    onEvent(id, payload.kind || type, payload);
  }

  function setStream(text, cls) {
    const s = $("stream");
    s.textContent = text;
    s.className = "pill " + (cls || "");
  }

  function stopStream() {
    if (view.streamCtrl) view.streamCtrl.abort();
    view.streamCtrl = null;
  }

  async function streamOnce() {
    const ctrl = new AbortController();
    view.streamCtrl = ctrl;
    const headers = {};
    if (view.lastEventId !== null) headers["Last-Event-ID"] = String(view.lastEventId);
    const resp = await fetch("/admin/events", { headers: authHeaders(headers), signal: ctrl.signal, cache: "no-store" });
    if (resp.status === 401) { askForKey("The daemon did not accept this key."); return false; }
    if (!resp.ok || !resp.body) throw new HttpError(resp.status, null);
    setStream("live", "live");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return true;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        parseBlock(buf.slice(0, i));
        buf = buf.slice(i + 2);
      }
    }
  }

  async function streamForever() {
    let delay = 250;
    for (;;) {
      if (view.streamPaused) { setStream("paused", "down"); await sleep(100); continue; }
      try {
        const keepGoing = await streamOnce();
        if (keepGoing === false) return;
        delay = 250;
      } catch (e) {
        if (!(e && e.name === "AbortError")) delay = Math.min(delay * 2, 5000);
      }
      view.streamCtrl = null;
      setStream("reconnecting", "down");
      await sleep(delay);
    }
  }

  // ---- start --------------------------------------------------------------------------

  async function whoami() {
    try {
      const me = await api("/admin/whoami");
      view.scopes = me.scopes;
      $("forget-key").hidden = !sessionStorage.getItem(KEY_STORE);
      const who = $("who");
      who.hidden = !me.auth_required;
      who.textContent = me.client ? `key ${me.client}: ${me.scopes.join(", ")}` : "";
      return true;
    } catch (e) {
      if (e.status === 401) return false;
      if (e.status === 404) { view.scopes = null; return true; }
      throw e;
    }
  }

  async function start() {
    if (!(await whoami())) return;
    $("key-form").hidden = true;
    if (!can("read")) {
      $("main").hidden = true;
      askForKey("This key has no 'read' scope: the dashboard needs it.");
      return;
    }
    const status = await api("/admin/status");
    view.lastEventId = status.journal && status.journal.enabled ? status.journal.committed_seq : null;
    await loadHistory();
    $("main").hidden = false;
    await refreshStatus();
    streamForever();
    setInterval(() => scheduleStatus(0), 5000);
  }

  function wire() {
    renderStateLegend();
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
      $("key-input").value = "";
      start().catch(showError);
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      location.reload();
    });
    for (const b of document.querySelectorAll(".zoom button")) {
      b.addEventListener("click", async () => {
        for (const o of document.querySelectorAll(".zoom button")) o.classList.toggle("active", o === b);
        view.range = Number(b.dataset.range);
        try { await loadHistory(); renderTimeline(); } catch (e) { showError(e); }
      });
    }
    window.addEventListener("resize", () => renderTimeline());
    setInterval(() => renderTimeline(), 15000);
    start().catch(showError);
  }

  // For tests and the curious: what the page has seen, and a way to drop the stream.
  window.mlxdDashboard = {
    view,
    dropStream() { stopStream(); },
    pauseStream() { view.streamPaused = true; stopStream(); },
    resumeStream() { view.streamPaused = false; },
  };

  document.addEventListener("DOMContentLoaded", wire);
})();
