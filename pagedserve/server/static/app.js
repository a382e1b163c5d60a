// The pagedserve playground: chat over /v1/chat/completions (SSE), conversations in
// localStorage, and the engine panel polling /v1/stats. Plain DOM, no framework, no build.
// Model text is rendered by Markdown.render (textContent only), never as HTML.
"use strict";

const STORE = "pagedserve.playground.v1";
const $ = (id) => document.getElementById(id);

const state = {
  conversations: [], // [{id, title, system, messages: [{role, content, choices?, selected?, error?}]}]
  current: null,
  streaming: null, // {controller, started, firstTokenAt, tokens}
  lastStats: null,
};

// ---------------------------------------------------------------- storage

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.conversations = Array.isArray(saved.conversations) ? saved.conversations : [];
    state.current = saved.current || null;
    for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "n", "so-kind", "so-text"]) {
      if (saved.settings && saved.settings[id] !== undefined) $(id).value = saved.settings[id];
    }
  } catch (e) {
    state.conversations = [];
  }
  $("api-key").value = sessionStorage.getItem(STORE + ".key") || "";
  if (!conversation()) newConversation();
}

function save() {
  const settings = {};
  for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "n", "so-kind", "so-text"]) {
    settings[id] = $(id).value;
  }
  localStorage.setItem(STORE, JSON.stringify({ conversations: state.conversations, current: state.current, settings }));
}

function conversation() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", system: "", messages: [] };
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  renderAll();
}

// ---------------------------------------------------------------- HTTP

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(response) {
  const body = await response.text();
  try {
    const parsed = JSON.parse(body);
    if (parsed.error && parsed.error.message) {
      return `${response.status}: ${parsed.error.message}` + (parsed.error.param ? ` (param: ${parsed.error.param})` : "");
    }
    if (parsed.detail) return `${response.status}: ${JSON.stringify(parsed.detail)}`;
  } catch (e) { /* not JSON */ }
  return `${response.status}: ${body || response.statusText}`;
}

async function loadModels() {
  const select = $("model");
  const previous = select.value || localStorage.getItem(STORE + ".model");
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    setStatus("server unreachable", true);
    return;
  }
  if (!response.ok) {
    setStatus(response.status === 401 ? "API key needed" : await errorText(response), true);
    return;
  }
  setStatus("");
  const data = (await response.json()).data || [];
  select.replaceChildren();
  for (const m of data) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.parent ? `${m.id} (LoRA on ${m.parent})` : m.id;
    select.appendChild(option);
  }
  if (data.some((m) => m.id === previous)) select.value = previous;
}

function setStatus(text, bad) {
  $("server-status").textContent = text;
  $("server-status").classList.toggle("bad", !!bad);
}

// ---------------------------------------------------------------- request body

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

function structuredOutput() {
  const kind = $("so-kind").value;
  const text = $("so-text").value.trim();
  if (kind === "json_object") return { response_format: { type: "json_object" } };
  if (kind === "json_schema") {
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (e) {
      throw new Error("the JSON schema box does not hold valid JSON: " + e.message);
    }
    return { response_format: { type: "json_schema", json_schema: { name: "playground", schema, strict: true } } };
  }
  if (kind === "regex") {
    if (!text) throw new Error("the regex box is empty");
    return { structured_outputs: { regex: text } };
  }
  return {};
}

function requestBody(conv) {
  const messages = [];
  if (conv.system.trim()) messages.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m.error) continue;
    const content = m.choices ? m.choices[m.selected || 0] : m.content;
    messages.push({ role: m.role, content });
  }
  const body = { model: $("model").value || undefined, messages, stream: true, stream_options: { include_usage: true } };
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top_p"], ["top_k", "top_k"],
    ["max_tokens", "max_tokens"], ["seed", "seed"], ["n", "n"]]) {
    const v = numberField(id);
    if (v !== undefined && !Number.isNaN(v)) body[field] = v;
  }
  return Object.assign(body, structuredOutput());
}

// ---------------------------------------------------------------- streaming

async function* sseEvents(response) {
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
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }
}

async function complete() {
  const conv = conversation();
  if (state.streaming || !conv) return;
  let body;
  try {
    body = requestBody(conv);
  } catch (e) {
    conv.messages.push({ role: "assistant", content: "", error: e.message });
    save();
    renderMessages();
    return;
  }
  const n = body.n || 1;
  const reply = { role: "assistant", content: "", choices: n > 1 ? new Array(n).fill("") : null, selected: 0, model: body.model };
  conv.messages.push(reply);
  const controller = new AbortController();
  const started = performance.now();
  state.streaming = { controller, started, firstTokenAt: null, tokens: 0, usage: null };
  setStreaming(true);
  renderMessages();
  let finishReasons = [];
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) state.streaming.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const text = (choice.delta && choice.delta.content) || "";
        if (text) {
          if (state.streaming.firstTokenAt === null) state.streaming.firstTokenAt = performance.now();
          state.streaming.tokens += 1;
          if (reply.choices) reply.choices[choice.index] += text;
          else reply.content += text;
          updateStreamingMessage(reply, choice.index);
        }
        if (choice.finish_reason) finishReasons[choice.index] = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = e.message;
  } finally {
    finishStats();
    state.streaming = null;
    setStreaming(false);
    reply.finish_reasons = finishReasons;
    if (conv.title === "New chat") {
      const firstUser = conv.messages.find((m) => m.role === "user");
      if (firstUser) conv.title = firstUser.content.slice(0, 40);
    }
    save();
    renderAll();
    pollStats();
  }
}

function finishStats() {
  const s = state.streaming;
  if (!s) return;
  const end = performance.now();
  const tokens = s.usage ? s.usage.completion_tokens : s.tokens;
  if (s.firstTokenAt !== null) {
    $("stat-ttft").textContent = ((s.firstTokenAt - s.started) / 1000).toFixed(2) + " s";
    const span = (end - s.firstTokenAt) / 1000;
    $("stat-tps").textContent = span > 0 && tokens > 1 ? ((tokens - 1) / span).toFixed(1) : "-";
  }
  $("reply-stats").textContent = `${tokens} tokens in ${((end - s.started) / 1000).toFixed(2)} s`;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("regenerate").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("streaming", on);
  schedulePoll();
}

function send() {
  const text = $("input").value;
  const conv = conversation();
  if (!text.trim() || state.streaming || !conv) return;
  conv.messages.push({ role: "user", content: text });
  $("input").value = "";
  save();
  renderMessages();
  complete();
}

function regenerate() {
  const conv = conversation();
  if (!conv || state.streaming) return;
  while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
  if (!conv.messages.length) return;
  complete();
}

function editAndResend(index, text) {
  const conv = conversation();
  if (!conv || state.streaming) return;
  conv.messages = conv.messages.slice(0, index);
  conv.messages.push({ role: "user", content: text });
  save();
  complete();
}

// ---------------------------------------------------------------- rendering

function renderAll() {
  renderConversations();
  const conv = conversation();
  $("system").value = conv ? conv.system : "";
  renderMessages();
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.textContent = c.title || "(untitled)";
    li.classList.toggle("current", c.id === state.current);
    li.addEventListener("click", () => {
      if (state.streaming) return;
      state.current = c.id;
      save();
      renderAll();
    });
    list.appendChild(li);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const conv = conversation();
  if (!conv) return;
  conv.messages.forEach((m, i) => box.appendChild(messageNode(m, i)));
  box.scrollTop = box.scrollHeight;
}

function messageNode(m, index) {
  const node = document.createElement("div");
  node.className = "message " + m.role;
  node.dataset.index = index;
  const head = document.createElement("div");
  head.className = "head";
  head.textContent = m.role === "user" ? "you" : (m.model || "assistant");
  node.appendChild(head);
  if (m.role === "user") {
    const bodyDiv = document.createElement("div");
    bodyDiv.className = "body";
    bodyDiv.appendChild(Markdown.render(m.content));
    node.appendChild(bodyDiv);
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "edit";
    edit.textContent = "Edit";
    edit.addEventListener("click", () => startEdit(node, m, index));
    head.appendChild(edit);
    return node;
  }
  if (m.choices) {
    const grid = document.createElement("div");
    grid.className = "choices";
    m.choices.forEach((text, k) => {
      const col = document.createElement("div");
      col.className = "choice body" + (k === (m.selected || 0) ? " selected" : "");
      col.dataset.choice = k;
      col.title = "click to continue the conversation with this choice";
      col.appendChild(Markdown.render(text));
      col.addEventListener("click", () => {
        if (state.streaming) return;
        m.selected = k;
        save();
        renderMessages();
      });
      grid.appendChild(col);
    });
    node.appendChild(grid);
  } else {
    const bodyDiv = document.createElement("div");
    bodyDiv.className = "body";
    bodyDiv.appendChild(Markdown.render(m.content));
    node.appendChild(bodyDiv);
  }
  if (m.stopped) node.appendChild(note("stopped", "muted"));
  if (m.error) node.appendChild(note(m.error, "error"));
  return node;
}

function note(text, className) {
  const div = document.createElement("div");
  div.className = className;
  div.textContent = text;
  return div;
}

function updateStreamingMessage(m, choiceIndex) {
  const box = $("messages");
  const node = box.lastElementChild;
  if (!node) return;
  const target = m.choices ? node.querySelector(`[data-choice="${choiceIndex}"]`) : node.querySelector(".body");
  if (!target) return;
  target.replaceChildren(Markdown.render(m.choices ? m.choices[choiceIndex] : m.content));
  box.scrollTop = box.scrollHeight;
}

function startEdit(node, m, index) {
  if (state.streaming) return;
  const area = document.createElement("textarea");
  area.value = m.content;
  area.rows = 3;
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = "Save & resend";
  button.addEventListener("click", () => editAndResend(index, area.value));
  node.querySelector(".body").replaceChildren(area, button);
  area.focus();
}

function exportConversation() {
  const conv = conversation();
  if (!conv) return;
  const blob = new Blob([JSON.stringify(conv, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `pagedserve-${conv.id}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ---------------------------------------------------------------- engine panel

let pollTimer = null;

function schedulePoll() {
  clearTimeout(pollTimer);
  pollTimer = setTimeout(pollStats, state.streaming ? 250 : 1000);
}

async function pollStats() {
  clearTimeout(pollTimer);
  try {
    const response = await fetch("v1/stats", { headers: headers() });
    if (response.ok) showStats(await response.json());
    else $("engine-state").textContent = response.status === 401 ? "(API key needed)" : `(${response.status})`;
  } catch (e) {
    $("engine-state").textContent = "(unreachable)";
  }
  schedulePoll();
}

function showStats(s) {
  const kv = s.kv_blocks;
  for (const part of ["used", "adapters", "cached", "free"]) {
    $("kv-seg-" + part).style.width = (100 * kv[part] / kv.total).toFixed(2) + "%";
    $("stat-kv-" + part).textContent = kv[part];
  }
  $("stat-kv-total").textContent = `${kv.total} × ${kv.block_size} tokens`;
  $("stat-running").textContent = s.requests.running;
  $("stat-waiting").textContent = s.requests.waiting;
  $("stat-preemptions").textContent = s.preemptions_total;
  const pc = s.prefix_cache;
  $("stat-prefix").textContent = `${(100 * pc.hit_rate).toFixed(1)}% (${pc.hits} / ${pc.queries} tokens)`;
  $("stat-gen-total").textContent = s.tokens.generation_total;
  const prev = state.lastStats;
  if (prev && s.time > prev.time) {
    const rate = (s.tokens.generation_total - prev.tokens.generation_total) / (s.time - prev.time);
    $("stat-engine-tps").textContent = rate.toFixed(1);
  }
  $("stat-adapters").textContent = s.adapters.resident.length ? s.adapters.resident.join(", ") : "none";
  const busy = s.requests.running + s.requests.waiting > 0;
  $("engine-state").textContent = busy ? "(busy)" : "(idle)";
  document.body.classList.toggle("engine-busy", busy);
  state.lastStats = s;
}

// ---------------------------------------------------------------- wiring

function init() {
  load();
  renderAll();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => state.streaming && state.streaming.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => !state.streaming && newConversation());
  $("export").addEventListener("click", exportConversation);
  $("delete-chat").addEventListener("click", () => {
    if (state.streaming) return;
    state.conversations = state.conversations.filter((c) => c.id !== state.current);
    state.current = state.conversations.length ? state.conversations[0].id : null;
    if (!conversation()) newConversation();
    save();
    renderAll();
  });
  $("system").addEventListener("input", () => {
    const conv = conversation();
    if (conv) { conv.system = $("system").value; save(); }
  });
  for (const id of ["temperature", "top_p", "top_k", "max_tokens", "seed", "n", "so-kind", "so-text"]) {
    $(id).addEventListener("change", save);
  }
  $("model").addEventListener("change", () => localStorage.setItem(STORE + ".model", $("model").value));
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(STORE + ".key", $("api-key").value.trim());
    loadModels();
    pollStats();
  });
  loadModels();
  pollStats();
}

document.addEventListener("DOMContentLoaded", init);
