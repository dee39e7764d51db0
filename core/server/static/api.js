// The server's OpenAI API, as the page uses it: the models served, and streamed chat completions.

import { serverSentEvents } from "./sse.js";

export class APIError extends Error {}

function headers(apiKey) {
  const result = { "Content-Type": "application/json" };
  if (apiKey) result.Authorization = `Bearer ${apiKey}`;
  return result;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error?.message) message = body.error.message;
  } catch {
    // not JSON: the status line says enough
  }
  return new APIError(message);
}

export async function listModels(apiKey) {
  const response = await fetch("/v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await failure(response);
  return (await response.json()).data.map((card) => card.id);
}

// Yields {reasoning, content, finishReason} for each chunk of the first choice.
export async function* streamChat(body, apiKey, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await failure(response);
  for await (const data of serverSentEvents(response)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new APIError(chunk.error.message);
    const choice = chunk.choices?.[0];
    if (!choice) continue;
    yield {
      reasoning: choice.delta?.reasoning_content ?? "",
      content: choice.delta?.content ?? "",
      finishReason: choice.finish_reason ?? null,
    };
  }
}
