"""Reading the server's answers on the client side: server-sent event streams of JSON chunks, and OpenAI
error bodies turned into exceptions that carry the server's message."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator

import httpx

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class ServerError(Exception):
    """The server refused a request (an HTTP error `status`), reported an error in the middle of a stream
    (`in_stream`), or sent something this client cannot read."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | int | None = None, retry_after: str | None = None, in_stream: bool = False):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.retry_after = retry_after
        self.in_stream = in_stream

    def __str__(self) -> str:
        retry = f" (retry after {self.retry_after} s)" if self.retry_after else ""
        if self.status is not None:
            return f"HTTP {self.status}: {self.message}{retry}"
        return f"error in the stream: {self.message}" if self.in_stream else self.message


def error_from_body(body: object, **context) -> ServerError:
    """The exception for an OpenAI error body `{"error": {...}}`, or for whatever else the server sent;
    `context` is ServerError's keyword arguments."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return ServerError(str(error.get("message") or error), type=error.get("type"), code=error.get("code"),
                           **context)
    if isinstance(error, str):
        return ServerError(error, **context)
    if isinstance(body, dict) and "detail" in body:  # FastAPI's own error shape
        return ServerError(str(body["detail"]), **context)
    return ServerError(str(body)[:500], **context)


def error_from_response(response: httpx.Response) -> ServerError:
    """The exception for an HTTP error response whose body has been read."""
    try:
        body = response.json()
    except ValueError:
        body = response.text.strip() or response.reason_phrase
    return error_from_body(body, status=response.status_code, retry_after=response.headers.get("retry-after"))


def check_status(response: httpx.Response) -> None:
    """Raise ServerError, with the server's message, if the response is an HTTP error."""
    if response.is_error:
        response.read()
        raise error_from_response(response)


async def acheck_status(response: httpx.Response) -> None:
    if response.is_error:
        await response.aread()
        raise error_from_response(response)


class SseDecoder:
    """Turns the text of an event stream, fed in pieces split anywhere, into the JSON objects its `data:`
    events carry. It stops at `data: [DONE]`, or at an error event, which it keeps in `error`."""

    def __init__(self) -> None:
        self._unfinished_line = ""
        self._ended_by_cr = False
        self._data_lines: list[str] = []
        self.done = False
        self.error: ServerError | None = None

    @property
    def stopped(self) -> bool:
        return self.done or self.error is not None

    def feed(self, text: str) -> list[dict]:
        """The events that `text` completes, in order, up to [DONE] or an error event."""
        events: list[dict] = []
        if not text:
            return events
        if self._ended_by_cr and text.startswith("\n"):
            text = text[1:]  # the second half of a \r\n split between pieces
        buffer = self._unfinished_line + text
        start = 0
        self._ended_by_cr = False
        for match in _LINE_BREAK.finditer(buffer):
            self._take_line(buffer[start:match.start()], events)
            start = match.end()
            self._ended_by_cr = match.group() == "\r" and start == len(buffer)
            if self.stopped:
                break
        self._unfinished_line = buffer[start:]
        return events

    def finish(self) -> list[dict]:
        """At the end of the stream: the events still pending. A stream that ends before [DONE] sets `error`,
        since the server closed it early."""
        events: list[dict] = []
        if not self.stopped:
            if self._unfinished_line:
                self._take_line(self._unfinished_line, events)
                self._unfinished_line = ""
            if not self.stopped:
                self._take_line("", events)
        if not self.stopped:
            self.error = ServerError("the stream ended without data: [DONE]; the server closed it early",
                                     in_stream=True)
        return events

    def _take_line(self, line: str, events: list[dict]) -> None:
        if not line:
            self._dispatch(events)
        elif not line.startswith(":"):  # a line starting with ':' is a comment (keep-alive)
            name, _, value = line.partition(":")
            if name == "data":
                self._data_lines.append(value[1:] if value.startswith(" ") else value)

    def _dispatch(self, events: list[dict]) -> None:
        if not self._data_lines:
            return
        data = "\n".join(self._data_lines)
        self._data_lines = []
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = ServerError(f"the stream carried data that is not JSON: {data[:200]!r}", in_stream=True)
            return
        if isinstance(event, dict) and event.get("error"):
            self.error = error_from_body(event, in_stream=True)
        elif not isinstance(event, dict):
            self.error = ServerError(f"the stream carried JSON that is not an object: {data[:200]!r}",
                                     in_stream=True)
        else:
            events.append(event)


def iter_events(response: httpx.Response) -> Iterator[dict]:
    """The JSON events of a streamed response (opened with `client.stream(...)`), raising ServerError on an
    HTTP error status, on an error event, or when the stream ends before [DONE]."""
    check_status(response)
    decoder = SseDecoder()
    for text in response.iter_text():
        yield from decoder.feed(text)
        if decoder.stopped:
            break
    else:
        yield from decoder.finish()
    if decoder.error is not None:
        raise decoder.error


async def aiter_events(response: httpx.Response) -> AsyncIterator[dict]:
    """iter_events for an httpx.AsyncClient's streamed response."""
    await acheck_status(response)
    decoder = SseDecoder()
    async for text in response.aiter_text():
        for event in decoder.feed(text):
            yield event
        if decoder.stopped:
            break
    else:
        for event in decoder.finish():
            yield event
    if decoder.error is not None:
        raise decoder.error
