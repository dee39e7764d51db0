// The data of each server-sent event in a fetch response's body, as it arrives.

export async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let boundary;
      while ((boundary = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, boundary);
        buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, "");
        const data = eventData(event);
        if (data !== null) yield data;
      }
    }
    const last = eventData(buffer + decoder.decode());
    if (last !== null) yield last;
  } finally {
    reader.releaseLock();
  }
}

function eventData(event) {
  const lines = event.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  return lines.length ? lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n") : null;
}
