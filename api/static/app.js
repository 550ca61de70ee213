// The chat page: plain JavaScript, no build step, no external resource. It speaks the server's
// OpenAI API (GET v1/models, POST v1/chat/completions with stream: true) and keeps everything
// it remembers (conversations, settings, the API key) in this browser's localStorage.
"use strict";

const KEYS = {
  conversations: "mlxTrio.conversations",
  current: "mlxTrio.current",
  settings: "mlxTrio.settings",
  apiKey: "mlxTrio.apiKey",
};
const SETTING_FIELDS = ["temperature", "top_p", "max_tokens", "response_format", "system", "tools"];
const $ = (id) => document.getElementById(id);

const state = {
  conversations: load(KEYS.conversations, []),
  currentId: load(KEYS.current, null),
  settings: load(KEYS.settings, {}),
  models: [], // GET v1/models entries
  images: [], // data: URLs pasted for the next message (vision models only)
  live: null, // {conversation, message, controller} while an answer streams
};
const messageElements = new WeakMap(); // message object -> its element, for live updates

// --- storage -------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    const value = localStorage.getItem(key);
    return value === null ? fallback : JSON.parse(value);
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(KEYS.conversations, JSON.stringify(state.conversations));
  localStorage.setItem(KEYS.current, JSON.stringify(state.currentId));
  localStorage.setItem(KEYS.settings, JSON.stringify(state.settings));
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

// --- HTTP ----------------------------------------------------------------------------------------

// fetch with the stored API key; a 401 asks for a key (dialog) and retries with it.
async function apiFetch(path, init = {}) {
  for (;;) {
    const headers = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEYS.apiKey);
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const entered = await askForKey(key ? "The server refused that API key. Enter another:" : "This server needs an API key.");
    if (!entered) return response;
    localStorage.setItem(KEYS.apiKey, entered);
    showKeyState();
  }
}

function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key-input").value = "";
  dialog.returnValue = ""; // Esc keeps the last value otherwise
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? $("key-input").value.trim() : ""), { once: true });
    dialog.showModal();
  });
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// Server-sent events from a fetch body: one callback per `data:` payload (JSON), until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    try {
      buffer = parseFrames(buffer + value, onData);
    } catch (e) {
      reader.cancel().catch(() => {}); // closes the connection: the server stops generating
      throw e;
    }
    if (buffer === null) return;
  }
}

// Hands every complete frame's data to `onData`; returns the unparsed rest, or null at [DONE].
function parseFrames(text, onData) {
  let buffer = text.replace(/\r\n?/g, "\n");
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const frame = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    const data = frame
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart())
      .join("\n");
    if (data === "[DONE]") return null;
    if (data) onData(JSON.parse(data));
  }
  return buffer;
}

// --- models and settings ------------------------------------------------------------------------

async function loadModels() {
  const response = await apiFetch("v1/models");
  if (!response.ok) {
    setStatus(`models: ${await errorText(response)}`);
    return;
  }
  state.models = (await response.json()).data || [];
  const select = $("model");
  select.replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  if (state.models.some((m) => m.id === state.settings.model)) select.value = state.settings.model;
  onModelChange();
}

function selectedModel() {
  return state.models.find((m) => m.id === $("model").value) || null;
}

// The image hook: pasting or attaching images is offered only for a model that reports vision.
function supportsVision(model) {
  return Boolean(model && (model.vision || (model.capabilities && model.capabilities.vision)));
}

function onModelChange() {
  state.settings.model = $("model").value;
  const vision = supportsVision(selectedModel());
  $("attach").hidden = !vision;
  if (!vision) setImages([]);
  save();
}

function readSettingsForm() {
  for (const name of SETTING_FIELDS) state.settings[name] = $(name).value;
  save();
}

function fillSettingsForm() {
  for (const name of SETTING_FIELDS) if (state.settings[name] !== undefined) $(name).value = state.settings[name];
}

function showKeyState() {
  const has = Boolean(localStorage.getItem(KEYS.apiKey));
  $("key-state").textContent = has ? "An API key is stored in this browser." : "No API key stored.";
  $("forget-key").hidden = !has;
}

function setStatus(text) {
  $("status").textContent = text;
}

// The request body: the conversation so far plus the settings that are set.
function requestBody(conversation) {
  const s = state.settings;
  const messages = [];
  if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of conversation.messages) {
    if (m.error || (m.role === "assistant" && !m.content && !m.toolCalls)) continue;
    let content = m.content;
    if (m.images && m.images.length) {
      content = [{ type: "text", text: m.content }, ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))];
    }
    messages.push({ role: m.role, content });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (s.model) body.model = s.model;
  if (s.temperature !== undefined && s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== undefined && s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.max_tokens !== undefined && s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
  if (s.response_format === "json_object") body.response_format = { type: "json_object" };
  if (s.tools && s.tools.trim()) body.tools = JSON.parse(s.tools); // a bad one is reported by send()
  return body;
}

// --- conversations ------------------------------------------------------------------------------

function newConversation() {
  const conversation = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  render();
  $("input").focus();
  return conversation;
}

function renderConversationList() {
  const list = $("conversations");
  list.replaceChildren(
    ...state.conversations.map((c) => {
      const item = document.createElement("li");
      item.className = c.id === state.currentId ? "conversation active" : "conversation";
      item.dataset.id = c.id;
      const open = button(c.title || "Untitled", "open", () => {
        state.currentId = c.id;
        save();
        render();
      });
      const rename = button("✎", "rename", () => {
        const title = prompt("Rename conversation", c.title);
        if (title && title.trim()) {
          c.title = title.trim();
          save();
          renderConversationList();
        }
      });
      rename.title = "Rename";
      const remove = button("×", "delete", () => {
        if (state.live && state.live.conversation === c) state.live.controller.abort();
        state.conversations = state.conversations.filter((x) => x !== c);
        if (state.currentId === c.id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
        save();
        render();
      });
      remove.title = "Delete";
      item.append(open, rename, remove);
      return item;
    }),
  );
}

function button(text, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

// --- messages -----------------------------------------------------------------------------------

function render() {
  renderConversationList();
  const conversation = current();
  const box = $("messages");
  box.replaceChildren(...(conversation ? conversation.messages.map(messageElement) : []));
  if (!conversation || !conversation.messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Ask something to start a conversation.";
    box.append(empty);
  }
  box.scrollTop = box.scrollHeight;
}

function messageElement(message) {
  const el = document.createElement("article");
  messageElements.set(message, el);
  fillMessage(el, message);
  return el;
}

function fillMessage(el, m) {
  el.className = `message ${m.role}${m.error ? " error" : ""}`;
  const parts = [];
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role;
  parts.push(role);
  if (m.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const wasOpen = el.querySelector("details.reasoning");
    details.open = Boolean(wasOpen && wasOpen.open);
    const summary = document.createElement("summary");
    summary.textContent = m.streaming && !m.content ? "Thinking…" : "Reasoning";
    const text = document.createElement("div");
    text.className = "reasoning-text";
    text.textContent = m.reasoning;
    details.append(summary, text);
    parts.push(details);
  }
  for (const url of m.images || []) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = url;
    img.alt = "attached image";
    parts.push(img);
  }
  const content = document.createElement("div");
  content.className = "content";
  const json = !m.streaming && m.role === "assistant" ? prettyJson(m.content) : null;
  if (json !== null) {
    content.append(pre(json, "json")); // a structured output: shown as formatted JSON
  } else if (m.role === "assistant") {
    content.innerHTML = renderMarkdown(m.content || ""); // escaped by renderMarkdown
  } else {
    content.textContent = m.content;
  }
  parts.push(content);
  for (const call of m.toolCalls || []) {
    const box = document.createElement("div");
    box.className = "tool-call";
    const name = document.createElement("div");
    name.className = "tool-name";
    name.textContent = `tool call: ${call.name || "?"}`;
    box.append(name, pre(prettyJson(call.arguments) ?? call.arguments, "json"));
    parts.push(box);
  }
  if (m.error) parts.push(textDiv("error-text", m.error));
  if (m.stats || m.stopped) parts.push(textDiv("stats", statsText(m)));
  el.replaceChildren(...parts);
}

function pre(text, className) {
  const p = document.createElement("pre");
  p.className = className;
  p.textContent = text;
  return p;
}

function textDiv(className, text) {
  const d = document.createElement("div");
  d.className = className;
  d.textContent = text;
  return d;
}

function prettyJson(text) {
  const t = (text || "").trim();
  if (!/^[[{]/.test(t)) return null;
  try {
    return JSON.stringify(JSON.parse(t), null, 2);
  } catch {
    return null;
  }
}

function statsText(m) {
  const parts = [];
  const s = m.stats || {};
  if (s.ttftMs !== undefined) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
  if (s.tokensPerSecond !== undefined) parts.push(`${s.tokensPerSecond.toFixed(1)} tok/s`);
  if (s.tokens !== undefined) parts.push(`${s.tokens} tokens${s.estimated ? " (counted in the page)" : ""}`);
  if (s.finish) parts.push(`finish: ${s.finish}`);
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

let pendingPaint = null;
function paintLive(message) {
  if (pendingPaint) return;
  pendingPaint = requestAnimationFrame(() => {
    pendingPaint = null;
    const el = messageElements.get(message);
    if (el && el.isConnected) {
      const box = $("messages");
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      fillMessage(el, message);
      if (atBottom) box.scrollTop = box.scrollHeight;
    }
  });
}

// --- sending --------------------------------------------------------------------------------------

async function send(text) {
  if (state.live) return;
  const conversation = current() || newConversation();
  const user = { role: "user", content: text };
  if (state.images.length) user.images = state.images.slice();
  let body;
  conversation.messages.push(user);
  try {
    body = requestBody(conversation);
  } catch (e) {
    conversation.messages.pop();
    setStatus(`Settings: tools is not valid JSON (${e.message})`);
    return;
  }
  setImages([]);
  if (conversation.title === "New chat") conversation.title = text.slice(0, 40) || "New chat";
  const answer = { role: "assistant", content: "", reasoning: "", streaming: true };
  conversation.messages.push(answer);
  const controller = new AbortController();
  state.live = { conversation, message: answer, controller };
  save();
  render();
  setBusy(true);
  setStatus("");
  await stream(body, answer, controller.signal);
  delete answer.streaming;
  state.live = null;
  save();
  setBusy(false);
  const el = messageElements.get(answer);
  if (el) fillMessage(el, answer);
}

// Streams one answer into `answer`, measuring TTFT and decode speed in the page.
async function stream(body, answer, signal) {
  const sentAt = performance.now();
  let firstAt = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  let savedAt = sentAt;
  const calls = [];
  try {
    const response = await apiFetch("v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal });
    if (!response.ok) {
      answer.error = await errorText(response);
      return;
    }
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      if (event.usage) usage = event.usage;
      const choice = (event.choices || [])[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = choice.delta || {};
      const reasoning = delta.reasoning ?? delta.reasoning_content; // this server sends `reasoning`
      if (delta.content || reasoning || delta.tool_calls) {
        if (firstAt === null) firstAt = performance.now();
        chunks++;
      }
      if (delta.content) answer.content += delta.content;
      if (reasoning) answer.reasoning += reasoning;
      for (const call of delta.tool_calls || []) {
        const slot = (calls[call.index ?? calls.length] ??= { name: "", arguments: "" });
        if (call.function && call.function.name) slot.name += call.function.name;
        if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
      }
      if (calls.length) answer.toolCalls = calls.filter(Boolean);
      paintLive(answer);
      if (performance.now() - savedAt > 1000) {
        savedAt = performance.now(); // a reload mid-answer keeps what has arrived
        save();
      }
    });
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = e.message || String(e);
  }
  const endAt = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  answer.stats = { tokens, estimated: !usage, finish: finish || undefined };
  if (firstAt !== null) {
    answer.stats.ttftMs = firstAt - sentAt;
    if (tokens > 1 && endAt > firstAt) answer.stats.tokensPerSecond = ((tokens - 1) * 1000) / (endAt - firstAt);
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function setImages(images) {
  state.images = images;
  const box = $("attachments");
  box.hidden = !images.length;
  box.replaceChildren(
    ...images.map((url) => {
      const img = document.createElement("img");
      img.className = "thumb";
      img.src = url;
      img.alt = "image to send";
      return img;
    }),
  );
}

function addImageFile(file) {
  const reader = new FileReader();
  reader.onload = () => setImages([...state.images, reader.result]);
  reader.readAsDataURL(file);
}

// --- wiring ----------------------------------------------------------------------------------------

function init() {
  fillSettingsForm();
  showKeyState();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.live) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("input").addEventListener("paste", (e) => {
    if (!supportsVision(selectedModel())) return;
    for (const item of e.clipboardData.items) if (item.type.startsWith("image/")) addImageFile(item.getAsFile());
  });
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", (e) => [...e.target.files].forEach(addImageFile));
  $("stop").addEventListener("click", () => state.live && state.live.controller.abort());
  $("new-chat").addEventListener("click", () => !state.live && newConversation());
  $("model").addEventListener("change", onModelChange);
  $("settings-toggle").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  });
  for (const name of SETTING_FIELDS) $(name).addEventListener("change", readSettingsForm);
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEYS.apiKey);
    showKeyState();
  });
  for (const c of state.conversations) {
    for (const m of c.messages) {
      if (m.streaming) {
        delete m.streaming; // the page was left while this answer streamed
        m.stopped = true;
      }
    }
  }
  if (!current() && state.conversations.length) state.currentId = state.conversations[0].id;
  render();
  loadModels().catch((e) => setStatus(`models: ${e.message}`));
}

init();
