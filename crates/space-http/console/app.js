// The SPACE web console: a small single-page app over the public API
// (/v1). The API key lives in this tab's session storage only; every
// request carries it as a bearer token, and the terminal's WebSocket
// offers it as a subprotocol (browsers cannot set headers there).
import { Terminal } from "/console/vendor/xterm.mjs";
import { FitAddon } from "/console/vendor/addon-fit.mjs";

const KEY = "space.key";
const $ = (id) => document.getElementById(id);
const views = ["sign-in-view", "sandboxes-view", "sandbox-view", "templates-view"];

const state = {
  sandboxes: new Map(), // id -> sandbox
  progress: new Map(), // sandbox id -> running operation
  usage: new Map(), // sandbox id -> latest usage
  events: null, // AbortController of the event stream
  current: null, // the sandbox page's id
  terminal: null, // { term, socket, fit }
  templates: [],
  buildOps: new Map(), // template name -> operation
};

// ---- the API -------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "error";
  }
}

async function api(method, path, { body, raw, headers } = {}) {
  const init = { method, headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY)}`, ...(headers || {}) } };
  if (body instanceof Blob || body instanceof ArrayBuffer) {
    init.body = body;
  } else if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(path, init);
  if (!response.ok) {
    let parsed = null;
    try { parsed = await response.json(); } catch (_) { /* not JSON */ }
    const error = new ApiError(response.status, parsed);
    if (response.status === 401 && sessionStorage.getItem(KEY)) signOut(error.message);
    throw error;
  }
  if (raw) return response;
  if (response.status === 204) return null;
  return response.json();
}

// ---- small helpers -------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function show(view) {
  for (const name of views) $(name).hidden = name !== view;
}

function notice(message, bad = false) {
  const box = $("notice");
  box.textContent = message;
  box.className = bad ? "error" : "";
  box.hidden = !message;
  if (message && !bad) setTimeout(() => { if (box.textContent === message) box.hidden = true; }, 5000);
}

const mib = (bytes) => `${(bytes / 1048576).toFixed(1)} MiB`;
const when = (text) => (text ? new Date(text).toLocaleString() : "");
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const labelsText = (labels) => Object.entries(labels || {}).map(([k, v]) => `${k}=${v}`).join(", ");

// ---- signing in and out --------------------------------------------------

async function signIn(key) {
  sessionStorage.setItem(KEY, key);
  try {
    await api("GET", "/v1/usage");
  } catch (error) {
    sessionStorage.removeItem(KEY);
    throw error;
  }
  $("nav").hidden = false;
  $("sign-out").hidden = false;
  startEvents();
  route();
}

function signOut(why) {
  sessionStorage.removeItem(KEY);
  if (state.events) state.events.abort();
  state.events = null;
  closeTerminal();
  state.sandboxes.clear();
  $("nav").hidden = true;
  $("sign-out").hidden = true;
  $("who").textContent = "";
  show("sign-in-view");
  const error = $("sign-in-error");
  error.textContent = why || "";
  error.hidden = !why;
}

$("sign-in").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("sign-in-error").hidden = true;
  try {
    await signIn($("key").value.trim());
    $("key").value = "";
  } catch (error) {
    const why = error.status === 401 ? `Sign-in refused: ${error.message}` : `Sign-in failed: ${error.message}`;
    $("key").value = "";
    signOut(why);
  }
});
$("sign-out").addEventListener("click", () => signOut());

// ---- events: the live feed everything else follows -----------------------

async function startEvents() {
  if (state.events) state.events.abort();
  const abort = new AbortController();
  state.events = abort;
  let last = null;
  let first = true;
  while (!abort.signal.aborted) {
    try {
      const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY)}` };
      if (last !== null) headers["Last-Event-ID"] = String(last);
      const response = await fetch("/v1/events?follow=true", { headers, signal: abort.signal });
      if (response.status === 401) { signOut("The API key is no longer valid."); return; }
      if (!response.ok) throw new Error(`events: HTTP ${response.status}`);
      $("live").textContent = "live";
      // The stream is open: what happens from here on arrives on it, so a
      // listing taken now misses nothing.
      if (first) { await loadSandboxes(); first = false; }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let newline;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline);
          buffer = buffer.slice(newline + 1);
          if (!line.trim()) continue;
          const event = JSON.parse(line);
          last = event.id;
          onEvent(event);
        }
      }
    } catch (error) {
      if (abort.signal.aborted) return;
    }
    $("live").textContent = "reconnecting…";
    await sleep(1000);
  }
}

function onEvent(event) {
  if (event.type === "gap") { loadSandboxes(); return; }
  if (event.sandbox) {
    const known = state.sandboxes.get(event.sandbox.id);
    if (!known || known.updated_at <= event.sandbox.updated_at) state.sandboxes.set(event.sandbox.id, event.sandbox);
    renderSandboxes();
    if (state.current === event.sandbox.id) renderSandbox();
    // The tenant's totals change with states; once a second at most.
    if (!state.usageDue) {
      state.usageDue = setTimeout(() => { state.usageDue = null; if (!$("sandboxes-view").hidden) loadUsage().catch(() => {}); }, 1000);
    }
  }
  if (event.operation) onOperation(event.operation);
  if (event.command && state.current === event.sandbox_id) loadCommands();
}

function onOperation(op) {
  const finished = ["succeeded", "failed", "cancelled"].includes(op.state);
  if (op.kind === "build_template") {
    state.buildOps.set(op.template, op);
    if (finished) loadTemplates(); else renderTemplates();
    return;
  }
  if (!op.sandbox_id) return;
  if (finished) state.progress.delete(op.sandbox_id); else state.progress.set(op.sandbox_id, op);
  if (op.state === "failed" && op.error) notice(`${op.kind} of ${op.sandbox_id} failed: ${op.error.message}`, true);
  renderSandboxes();
  if (state.current === op.sandbox_id) renderSandbox();
}

// ---- the sandbox list ----------------------------------------------------

async function loadSandboxes() {
  const { sandboxes } = await api("GET", "/v1/sandboxes");
  for (const sandbox of sandboxes) state.sandboxes.set(sandbox.id, sandbox);
  renderSandboxes();
  if (state.current) renderSandbox();
}

function visibleSandboxes() {
  const wanted = $("filter-state").value;
  const text = $("filter-text").value.trim().toLowerCase();
  return [...state.sandboxes.values()]
    .filter((s) => (wanted ? s.state === wanted : s.state !== "deleted"))
    .filter((s) => !text || [s.id, s.template, labelsText(s.labels)].some((f) => f.toLowerCase().includes(text)))
    .sort((a, b) => (a.created_at < b.created_at ? 1 : -1));
}

function actionButtons(sandbox) {
  const box = el("div", { class: "row" });
  const busy = state.progress.has(sandbox.id);
  const act = (label, path, method = "POST", cls = "secondary") =>
    el("button", {
      class: cls, text: label, "data-action": label.toLowerCase(),
      onclick: async (event) => {
        event.stopPropagation();
        try {
          const { operation } = await api(method, path, method === "POST" ? { body: {} } : {});
          state.progress.set(sandbox.id, operation);
          renderSandboxes();
        } catch (error) { notice(`${label} ${sandbox.id}: ${error.message}`, true); }
      },
    });
  const base = `/v1/sandboxes/${sandbox.id}`;
  if (sandbox.state === "running") box.append(act("Pause", `${base}/pause`), act("Suspend", `${base}/suspend`));
  if (sandbox.state === "paused" || sandbox.state === "suspended") box.append(act("Resume", `${base}/resume`));
  if (sandbox.state !== "deleted" && sandbox.state !== "deleting") {
    // Two clicks: the first arms it for a few seconds (kept across re-renders).
    const armed = state.armed === sandbox.id;
    const remove = el("button", { class: "danger", text: armed ? "Confirm delete" : "Delete", "data-action": "delete" });
    remove.addEventListener("click", async (event) => {
      event.stopPropagation();
      if (state.armed !== sandbox.id) {
        state.armed = sandbox.id;
        setTimeout(() => { if (state.armed === sandbox.id) { state.armed = null; rerender(); } }, 5000);
        rerender();
        return;
      }
      state.armed = null;
      try {
        const { operation } = await api("DELETE", base);
        state.progress.set(sandbox.id, operation);
        rerender();
      } catch (error) { notice(`Delete ${sandbox.id}: ${error.message}`, true); }
    });
    box.append(remove);
  }
  for (const button of box.querySelectorAll("button")) button.disabled = busy;
  return box;
}

function rerender() {
  renderSandboxes();
  if (state.current) renderSandbox();
}

function progressText(op) {
  return op ? `${op.kind}: ${op.progress.step} (${op.progress.done}/${op.progress.total})` : "";
}

function renderSandboxes() {
  const body = $("sandboxes").querySelector("tbody");
  const rows = visibleSandboxes().map((s) => {
    const usage = state.usage.get(s.id);
    const op = state.progress.get(s.id);
    const row = el("tr", { class: "clickable", "data-id": s.id, onclick: () => { location.hash = `#/sandboxes/${s.id}`; } },
      el("td", {}, el("code", { text: s.id })),
      el("td", {}, el("span", { class: `state state-${s.state}`, text: s.state }), op ? el("div", { class: "muted", text: progressText(op) }) : null),
      el("td", { text: s.template }),
      el("td", { text: `${s.vcpus} vCPU, ${s.memory_mib} MiB` }),
      el("td", { text: usage && s.state === "running" ? `${usage.cpu_percent.toFixed(1)}%` : "" }),
      el("td", { text: usage && s.state === "running" ? mib(usage.memory_bytes) : "" }),
      el("td", { text: labelsText(s.labels) }),
      el("td", { text: when(s.created_at) }),
      el("td", {}, actionButtons(s)));
    return row;
  });
  body.replaceChildren(...rows);
  $("sandboxes-empty").hidden = rows.length > 0;
}

$("filter-state").addEventListener("change", renderSandboxes);
$("filter-text").addEventListener("input", renderSandboxes);

async function loadUsage() {
  const usage = await api("GET", "/v1/usage");
  const q = usage.quotas;
  const of = (value, limit, unit = "") => (limit ? `${value}${unit} of ${limit}${unit}` : `${value}${unit}`);
  $("who").textContent = `tenant ${usage.tenant}`;
  $("usage").replaceChildren(
    el("strong", { text: "Usage " }),
    el("span", { text: `${of(usage.sandboxes, q.max_sandboxes)} sandboxes · ${of(usage.vcpus, q.max_vcpus)} vCPUs · ` +
      `${of(usage.memory_mib, q.max_memory_mib, " MiB")} memory · ${mib(usage.disk.total_bytes)} disk` +
      (q.max_disk_mib ? ` of ${q.max_disk_mib} MiB` : "") }));
}

async function loadTemplateChoices() {
  const { templates } = await api("GET", "/v1/templates");
  state.templates = templates;
  const select = $("create-template");
  const chosen = select.value;
  select.replaceChildren(...templates.filter((t) => t.state === "ready").map((t) => el("option", { value: t.name, text: t.name })));
  if (chosen) select.value = chosen;
}

$("create").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = { template: $("create-template").value };
  if ($("create-vcpus").value) body.vcpus = Number($("create-vcpus").value);
  if ($("create-memory").value) body.memory_mib = Number($("create-memory").value);
  const labels = $("create-labels").value.split(",").map((p) => p.trim()).filter(Boolean);
  if (labels.length) {
    body.labels = {};
    for (const pair of labels) {
      const [key, ...rest] = pair.split("=");
      body.labels[key.trim()] = rest.join("=").trim();
    }
  }
  try {
    const { sandbox, operation } = await api("POST", "/v1/sandboxes", { body });
    state.sandboxes.set(sandbox.id, sandbox);
    state.progress.set(sandbox.id, operation);
    renderSandboxes();
    notice(`Creating ${sandbox.id}`);
  } catch (error) { notice(`Create: ${error.message}`, true); }
});

// Usage figures of running sandboxes on screen, every 5 s.
async function pollUsage() {
  for (;;) {
    await sleep(5000);
    if (!sessionStorage.getItem(KEY)) continue;
    const ids = state.current ? [state.current] :
      $("sandboxes-view").hidden ? [] : visibleSandboxes().filter((s) => s.state === "running").slice(0, 50).map((s) => s.id);
    for (const id of ids) {
      try { state.usage.set(id, await api("GET", `/v1/sandboxes/${id}/metrics`)); } catch (_) { /* gone */ }
    }
    if (state.current) renderUsage(); else renderSandboxes();
  }
}

// ---- one sandbox ---------------------------------------------------------

async function openSandbox(id) {
  if (state.current !== id) closeTerminal();
  state.current = id;
  show("sandbox-view");
  $("transcript").hidden = true;
  try {
    state.sandboxes.set(id, await api("GET", `/v1/sandboxes/${id}`));
  } catch (error) {
    notice(`${id}: ${error.message}`, true);
    location.hash = "#/";
    return;
  }
  renderSandbox();
  loadCommands();
  refreshUsage();
  if (state.sandboxes.get(id).state === "running") listFiles($("files-path").value || "/root");
}

function renderSandbox() {
  const s = state.sandboxes.get(state.current);
  if (!s) return;
  $("sbx-id").textContent = s.id;
  $("sbx-state").textContent = s.state;
  $("sbx-state").className = `state state-${s.state}`;
  $("sbx-facts").textContent = `· ${s.template} · ${s.engine} · ${s.vcpus} vCPU · ${s.memory_mib} MiB · disk ${s.disk_mib} MiB · created ${when(s.created_at)}` +
    (Object.keys(s.labels || {}).length ? ` · ${labelsText(s.labels)}` : "");
  $("sbx-failure").hidden = !s.failure_reason;
  $("sbx-failure").textContent = s.failure_reason || "";
  $("sbx-progress").textContent = progressText(state.progress.get(s.id));
  $("sbx-actions").replaceChildren(actionButtons(s));
  $("term-open").disabled = s.state !== "running";
}

async function refreshUsage() {
  try { state.usage.set(state.current, await api("GET", `/v1/sandboxes/${state.current}/metrics`)); } catch (_) { return; }
  renderUsage();
}

function renderUsage() {
  const u = state.usage.get(state.current);
  if (!u) return;
  $("sbx-usage").textContent = `CPU ${u.cpu_percent.toFixed(1)}% (${u.cpu_seconds.toFixed(2)} s) · memory ${mib(u.memory_bytes)} of ${mib(u.memory_limit_bytes)} · ` +
    `disk ${mib(u.disk_bytes)} of ${mib(u.disk_quota_bytes)} · ${u.commands} commands (${u.commands_running} running)`;
  drawGraph($("sbx-graph"), u);
}

// CPU percent (blue) and memory against its limit (green) over the history.
function drawGraph(canvas, usage) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = "#dde1ea";
  for (let y = 0; y <= 4; y++) { ctx.beginPath(); ctx.moveTo(0, (y * height) / 4); ctx.lineTo(width, (y * height) / 4); ctx.stroke(); }
  const points = usage.history;
  if (points.length < 2) return;
  const line = (color, value) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach((p, i) => {
      const x = (i / (points.length - 1)) * width;
      const y = height - Math.min(1, Math.max(0, value(p))) * (height - 4) - 2;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  };
  line("#2b59c3", (p) => p.cpu_percent / 100);
  line("#1e7b34", (p) => p.memory_bytes / usage.memory_limit_bytes);
  ctx.fillStyle = "#687086";
  ctx.font = "12px system-ui";
  ctx.fillText("CPU % (blue), memory of limit (green)", 8, 14);
}

async function loadCommands() {
  const id = state.current;
  let commands;
  try { ({ commands } = await api("GET", `/v1/sandboxes/${id}/commands`)); } catch (_) { return; }
  if (state.current !== id) return;
  const rows = commands.slice().reverse().map((c) => el("tr", { class: "clickable", "data-id": c.id, onclick: () => showTranscript(c) },
    el("td", {}, el("code", { text: c.argv.join(" ") })),
    el("td", { text: c.state }),
    el("td", { text: resultText(c.result) }),
    el("td", { text: when(c.started_at) })));
  $("commands").querySelector("tbody").replaceChildren(...rows);
}

function resultText(result) {
  if (!result) return "";
  if (result.timed_out) return "timed out";
  if (result.exit_code !== null && result.exit_code !== undefined) return `exit ${result.exit_code} · ${result.duration_ms} ms`;
  if (result.signal) return `killed by ${result.signal}`;
  return result.error || "ended";
}

async function showTranscript(command) {
  $("transcript").hidden = false;
  $("transcript-title").textContent = command.argv.join(" ");
  const out = $("transcript-output");
  out.replaceChildren();
  $("transcript-result").textContent = "";
  const response = await api("GET", `/v1/sandboxes/${state.current}/commands/${command.id}/output`, { raw: true });
  const text = await response.text();
  for (const line of text.split("\n")) {
    if (!line.trim()) continue;
    const frame = JSON.parse(line);
    if (frame.type === "exit") { $("transcript-result").textContent = resultText(frame.result); continue; }
    const data = frame.data !== undefined ? frame.data : atob(frame.data_b64 || "");
    out.append(frame.type === "stderr" ? el("span", { class: "stderr", text: data }) : document.createTextNode(data));
  }
}

$("exec").addEventListener("submit", async (event) => {
  event.preventDefault();
  const cmd = $("exec-cmd").value;
  try {
    const answer = await api("POST", `/v1/sandboxes/${state.current}/exec?auto_resume=true`, { body: { cmd } });
    await loadCommands();
    showTranscript(answer.command);
  } catch (error) { notice(`Run: ${error.message}`, true); }
});

// ---- files ---------------------------------------------------------------

const filesUrl = (path) => `/v1/sandboxes/${state.current}/files?path=${encodeURIComponent(path)}`;
const joinPath = (dir, name) => (dir.endsWith("/") ? dir + name : `${dir}/${name}`);

async function listFiles(path) {
  $("files-path").value = path;
  let listing;
  try { listing = await api("GET", filesUrl(path)); } catch (error) { notice(`Files: ${error.message}`, true); return; }
  const rows = [];
  if (path !== "/") {
    const parent = path.replace(/\/[^/]*\/?$/, "") || "/";
    rows.push(el("tr", { class: "clickable", onclick: () => listFiles(parent) }, el("td", { text: ".." }), el("td", { text: "dir" }), el("td"), el("td")));
  }
  for (const entry of listing.entries) {
    const full = joinPath(path, entry.name);
    const open = entry.type === "dir" ? () => listFiles(full) : () => download(full, entry.name);
    rows.push(el("tr", { class: "clickable", "data-name": entry.name, onclick: open },
      el("td", { text: entry.name }), el("td", { text: entry.type }),
      el("td", { text: entry.type === "file" ? String(entry.size) : "" }), el("td", { text: when(entry.mtime) })));
  }
  $("files").querySelector("tbody").replaceChildren(...rows);
}

async function download(path, name) {
  try {
    const response = await api("GET", filesUrl(path), { raw: true });
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (error) { notice(`Download: ${error.message}`, true); }
}

$("files-go").addEventListener("submit", (event) => { event.preventDefault(); listFiles($("files-path").value); });
$("files-upload").addEventListener("change", async () => {
  const file = $("files-upload").files[0];
  if (!file) return;
  const dir = $("files-path").value;
  try {
    await api("PUT", filesUrl(joinPath(dir, file.name)), { body: file });
    notice(`Uploaded ${file.name}`);
    listFiles(dir);
  } catch (error) { notice(`Upload: ${error.message}`, true); }
  $("files-upload").value = "";
});

// ---- the terminal --------------------------------------------------------

function base64url(text) {
  return btoa(String.fromCharCode(...new TextEncoder().encode(text))).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function closeTerminal() {
  if (!state.terminal) return;
  state.terminal.socket.close();
  state.terminal.term.dispose();
  state.terminal = null;
  $("terminal").replaceChildren();
  $("term-status").textContent = "";
}

$("term-open").addEventListener("click", async () => {
  closeTerminal();
  const id = state.current;
  let command;
  try {
    ({ command } = await api("POST", `/v1/sandboxes/${id}/commands`, {
      body: { argv: ["/bin/sh", "-c", "command -v bash >/dev/null && exec bash -l; exec sh -l"], tty: true, stdin: true, env: { TERM: "xterm-256color" }, tag: "console-terminal" },
    }));
  } catch (error) { notice(`Terminal: ${error.message}`, true); return; }
  const term = new Terminal({ cursorBlink: true, fontSize: 13, convertEol: false });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open($("terminal"));
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const url = `${scheme}://${location.host}/v1/sandboxes/${id}/commands/${command.id}/attach`;
  const socket = new WebSocket(url, ["space.v1", `bearer.${base64url(sessionStorage.getItem(KEY))}`]);
  socket.binaryType = "arraybuffer";
  state.terminal = { term, socket, fit };
  const resize = () => {
    fit.fit();
    if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ resize: { cols: term.cols, rows: term.rows } }));
  };
  socket.onopen = () => { $("term-status").textContent = "connected"; resize(); term.focus(); };
  socket.onmessage = (message) => {
    if (typeof message.data === "string") {
      const text = JSON.parse(message.data);
      if (text.exit) $("term-status").textContent = `ended: ${resultText(text.exit)}`;
      if (text.error) notice(`Terminal: ${text.error.message}`, true);
      return;
    }
    term.write(new Uint8Array(message.data));
  };
  socket.onclose = () => { if ($("term-status").textContent === "connected") $("term-status").textContent = "disconnected"; };
  const encoder = new TextEncoder();
  term.onData((data) => { if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data)); });
  window.addEventListener("resize", () => { if (state.terminal && state.terminal.term === term) resize(); });
  loadCommands();
});

// ---- templates -----------------------------------------------------------

async function loadTemplates() {
  try { ({ templates: state.templates } = await api("GET", "/v1/templates")); } catch (_) { return; }
  renderTemplates();
}

function renderTemplates() {
  const rows = state.templates.map((t) => {
    const op = state.buildOps.get(t.name);
    const building = op && !["succeeded", "failed", "cancelled"].includes(op.state);
    const build = building ? progressText(op) : op ? `${op.state}` : "";
    const opId = (op && op.id) || t.building_operation;
    return el("tr", { "data-name": t.name },
      el("td", {}, el("code", { text: t.name })),
      el("td", { class: `state state-${t.state}`, text: t.state }),
      el("td", { text: t.version === undefined ? "" : String(t.version) }),
      el("td", { text: t.engine || "default" }),
      el("td", { text: when(t.created_at) }),
      el("td", {}, el("span", { class: "muted", text: `${build} ` }),
        opId ? el("button", { class: "secondary", text: "Log", onclick: () => showBuildLog(t.name, opId) }) : null));
  });
  $("templates").querySelector("tbody").replaceChildren(...rows);
}

async function showBuildLog(name, opId) {
  $("build-log-box").hidden = false;
  $("build-log-title").textContent = `Build log of ${name} (${opId})`;
  try {
    const response = await api("GET", `/v1/operations/${opId}/log`, { raw: true });
    $("build-log").textContent = await response.text();
  } catch (error) { $("build-log").textContent = error.message; }
}

$("build").addEventListener("submit", async (event) => {
  event.preventDefault();
  const packages = $("build-packages").value.split(",").map((p) => p.trim()).filter(Boolean);
  const body = { name: $("build-name").value.trim(), from: { debian: { packages } } };
  try {
    const { operation } = await api("POST", "/v1/templates", { body });
    state.buildOps.set(body.name, operation);
    await loadTemplates();
    notice(`Building ${body.name}`);
  } catch (error) { notice(`Build: ${error.message}`, true); }
});

// ---- routing -------------------------------------------------------------

async function route() {
  if (!sessionStorage.getItem(KEY)) { show("sign-in-view"); return; }
  const hash = location.hash || "#/";
  const sandbox = hash.match(/^#\/sandboxes\/([A-Za-z0-9_]+)$/);
  if (sandbox) { openSandbox(sandbox[1]); return; }
  state.current = null;
  closeTerminal();
  if (hash === "#/templates") {
    show("templates-view");
    loadTemplates();
    return;
  }
  show("sandboxes-view");
  renderSandboxes();
  try { await Promise.all([loadUsage(), loadTemplateChoices()]); } catch (error) { if (error.status !== 401) notice(error.message, true); }
}

window.addEventListener("hashchange", route);
pollUsage();
if (sessionStorage.getItem(KEY)) {
  signIn(sessionStorage.getItem(KEY)).catch((error) => signOut(`Sign-in refused: ${error.message}`));
} else {
  show("sign-in-view");
}
