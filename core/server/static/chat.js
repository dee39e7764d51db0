// The chat page: conversations, the composer, settings, and an assistant answer streaming in.

import { listModels, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { loadConversations, loadSettings, newConversation, saveConversations, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTING_FIELDS = { apiKey: "api-key", temperature: "temperature", topP: "top-p", maxTokens: "max-tokens",
  thinking: "thinking" };

let conversations = loadConversations();
let current = conversations[0] ?? newConversation();
let controller = null;

function settings() {
  return Object.fromEntries(Object.entries(SETTING_FIELDS).map(([name, id]) => [name, $(id).value.trim()]));
}

function requestBody(messages) {
  const chosen = settings();
  const body = { model: $("model").value || undefined, messages };
  if (chosen.temperature !== "") body.temperature = Number(chosen.temperature);
  if (chosen.topP !== "") body.top_p = Number(chosen.topP);
  if (chosen.maxTokens !== "") body.max_tokens = Number(chosen.maxTokens);
  if (chosen.thinking) body.chat_template_kwargs = { enable_thinking: chosen.thinking === "on" };
  return body;
}

function messageView(message) {
  const article = document.createElement("article");
  article.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : "Assistant";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.hidden = true;
  thinking.innerHTML = "<summary>Thinking</summary><div class=\"thinking-body\"></div>";
  const content = document.createElement("div");
  content.className = message.role === "user" ? "content plain" : "content markdown";
  const note = document.createElement("div");
  note.className = "note";
  article.append(role, thinking, content, note);

  let opened = false;
  function update() {
    article.dataset.state = message.state ?? "done";
    if (message.reasoning) {
      thinking.hidden = false;
      thinking.querySelector(".thinking-body").textContent = message.reasoning;
      if (!opened && message.state === "streaming" && !message.content) thinking.open = opened = true;
      if (opened && message.content && thinking.dataset.closed !== "yes") {
        thinking.open = false;
        thinking.dataset.closed = "yes";
      }
      thinking.querySelector("summary").textContent =
        message.state === "streaming" && !message.content ? "Thinking…" : "Thought";
    }
    if (message.role === "user") content.textContent = message.content;
    else content.innerHTML = renderMarkdown(message.content);
    note.textContent = noteFor(message);
  }
  update();
  return { article, update };
}

function noteFor(message) {
  if (message.state === "streaming") return message.content || message.reasoning ? "" : "…";
  if (message.state === "stopped") return "Stopped.";
  if (message.state === "error") return `Error: ${message.error}`;
  if (message.finishReason === "length") return "Cut off at the token limit.";
  return "";
}

function showConversation() {
  const list = $("messages");
  list.replaceChildren();
  if (!current.messages.length) {
    list.innerHTML = "<p class=\"empty\">Ask the model something.</p>";
  }
  const views = current.messages.map(messageView);
  list.append(...views.map((view) => view.article));
  list.scrollTop = list.scrollHeight;
  showHistory();
  return views;
}

function showHistory() {
  const history = $("history");
  history.replaceChildren();
  for (const conversation of conversations) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = conversation === current ? "conversation current" : "conversation";
    button.textContent = conversation.title;
    button.title = conversation.title;
    button.addEventListener("click", () => switchTo(conversation));
    history.append(button);
  }
}

function switchTo(conversation) {
  controller?.abort();
  current = conversation;
  showConversation();
  $("prompt").focus();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

async function send(text) {
  const history = current.messages
    .filter((m) => m.role === "user" || (m.content && m.state !== "error"))
    .map((m) => ({ role: m.role, content: m.content }));
  const user = { role: "user", content: text };
  const answer = { role: "assistant", content: "", reasoning: "", state: "streaming" };
  if (!current.messages.length) {
    current.title = text.length > 40 ? `${text.slice(0, 40)}…` : text;
    conversations.unshift(current);
  }
  const conversation = current;
  conversation.messages.push(user, answer);
  const { update } = showConversation().at(-1);

  const ownController = new AbortController();
  controller = ownController;
  setBusy(true);
  let scheduled = false;
  const redraw = () => {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      if (conversation === current) {
        update();
        followAnswer();
      }
    });
  };
  try {
    for await (const delta of streamChat(requestBody([...history, user]), settings().apiKey, ownController.signal)) {
      answer.reasoning += delta.reasoning;
      answer.content += delta.content;
      if (delta.finishReason) answer.finishReason = delta.finishReason;
      redraw();
    }
    answer.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      answer.state = "stopped";
    } else {
      answer.state = "error";
      answer.error = error.message;
    }
  } finally {
    if (controller === ownController) controller = null;
    setBusy(controller !== null);
    if (conversation === current) update();
    saveConversations(conversations);
  }
}

function followAnswer() {
  const list = $("messages");
  if (list.scrollHeight - list.scrollTop - list.clientHeight < 120) list.scrollTop = list.scrollHeight;
}

async function refreshModels() {
  const select = $("model");
  const status = $("server-status");
  try {
    const models = await listModels(settings().apiKey);
    const chosen = select.value || loadSettings().model;
    select.replaceChildren(...models.map((id) => new Option(id, id)));
    if (models.includes(chosen)) select.value = chosen;
    status.textContent = "";
    status.classList.remove("error");
  } catch (error) {
    select.replaceChildren();
    status.textContent = error.name === "TypeError" ? "Cannot reach the server." : error.message;
    status.classList.add("error");
  }
}

function storeSettings() {
  saveSettings({ ...settings(), model: $("model").value });
}

function restoreSettings() {
  const saved = loadSettings();
  for (const [name, id] of Object.entries(SETTING_FIELDS)) {
    if (typeof saved[name] === "string") $(id).value = saved[name];
  }
}

function copyCode(event) {
  const button = event.target.closest(".copy-code");
  if (!button) return;
  const code = button.closest(".code-block").querySelector("code").textContent;
  navigator.clipboard?.writeText(code).then(() => {
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  }, () => {});
}

function start() {
  restoreSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => switchTo(newConversation()));
  $("messages").addEventListener("click", copyCode);
  for (const id of Object.values(SETTING_FIELDS)) $(id).addEventListener("change", storeSettings);
  $("model").addEventListener("change", storeSettings);
  $("api-key").addEventListener("change", refreshModels);
  showConversation();
  refreshModels();
}

start();
