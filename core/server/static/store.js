// Conversations and settings, kept in the browser's localStorage.

const CONVERSATIONS = "candelabra.conversations";
const SETTINGS = "candelabra.settings";

function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

export function loadConversations() {
  const conversations = read(CONVERSATIONS, []);
  return Array.isArray(conversations) ? conversations.filter((c) => Array.isArray(c.messages)) : [];
}

export function saveConversations(conversations) {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(conversations.filter((c) => c.messages.length)));
}

export function loadSettings() {
  return read(SETTINGS, {});
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export function newConversation() {
  return { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: "New chat", messages: [] };
}
