"""Reading server-sent event streams and OpenAI error bodies on the client side."""

import asyncio
import json
import random

import httpx
import pytest

from candelabra.core.clients.sse_client import ServerError, SseDecoder, aiter_events, iter_events

CHUNKS = [
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "héllo\u2028wörld 🕯"}}]},
    {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]


def stream_text(events, line_break="\n", done=True):
    text = "".join(f"data: {json.dumps(e, ensure_ascii=False)}{line_break}{line_break}" for e in events)
    return text + (f"data: [DONE]{line_break}{line_break}" if done else "")


def decode_in_pieces(text, cuts):
    decoder = SseDecoder()
    events, start = [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += decoder.feed(text[start:cut]) + decoder.feed("")
        start = cut
    return decoder, events


@pytest.mark.parametrize("line_break", ["\n", "\r\n", "\r"])
def test_events_come_out_whole_wherever_the_stream_is_split(line_break):
    text = stream_text(CHUNKS, line_break)
    rng = random.Random(1)
    splits = [[], list(range(1, len(text)))] + [rng.sample(range(1, len(text)), k) for k in (1, 3, 10) * 5]
    for cuts in splits:
        decoder, events = decode_in_pieces(text, cuts)
        assert events == CHUNKS and decoder.done and decoder.error is None


def test_nothing_is_read_after_done():
    decoder = SseDecoder()
    events = decoder.feed(stream_text(CHUNKS[:1]) + stream_text(CHUNKS[1:]))
    assert events == CHUNKS[:1] and decoder.done
    assert decoder.feed(stream_text(CHUNKS)) == []


def test_an_error_event_stops_the_stream_with_the_servers_message():
    error = {"error": {"message": "prompt is too long", "type": "invalid_request_error", "param": None, "code": 400}}
    decoder = SseDecoder()
    events = decoder.feed(stream_text([CHUNKS[0], error, CHUNKS[1]]))
    assert events == [CHUNKS[0]]
    assert decoder.error.message == "prompt is too long" and decoder.error.type == "invalid_request_error"
    assert decoder.error.code == 400 and decoder.error.status is None and decoder.error.in_stream
    assert str(decoder.error) == "error in the stream: prompt is too long" and not decoder.done


@pytest.mark.parametrize("line_break", ["\n", "\r\n", "\r"])
def test_comments_other_fields_and_multiline_data(line_break):
    lines = [": keep-alive", "", "event: message", "id: 7", "retry: 100", 'data: {"a":', "data:[1,", "data:  2]}", "",
             "data: [DONE]", "", ""]
    text = line_break.join(lines)
    for cut in range(len(text) + 1):
        decoder, events = decode_in_pieces(text, [cut])
        assert events == [{"a": [1, 2]}] and decoder.done


def test_a_stream_cut_short_is_an_error_but_a_last_unterminated_done_is_not():
    cut_short = SseDecoder()
    assert cut_short.feed(stream_text(CHUNKS[:1], done=False)) == CHUNKS[:1]
    assert cut_short.finish() == []
    assert "without data: [DONE]" in cut_short.error.message

    unterminated = SseDecoder()
    assert unterminated.feed(stream_text(CHUNKS[:1], done=False) + "data: {\"b\": 2}\n\ndata: [DONE]") == \
        [CHUNKS[0], {"b": 2}]
    assert unterminated.finish() == [] and unterminated.done and unterminated.error is None


@pytest.mark.parametrize("data", ["{not json", "[1, 2]"])
def test_data_that_is_not_a_json_object_is_an_error(data):
    decoder = SseDecoder()
    assert decoder.feed(f"data: {data}\n\n") == []
    assert data in decoder.error.message


def byte_pieces(text, size):
    raw = text.encode()
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def test_iter_events_reads_bytes_split_inside_characters():
    pieces = byte_pieces(stream_text(CHUNKS), 3)
    assert list(iter_events(httpx.Response(200, content=iter(pieces)))) == CHUNKS

    async def read_all(response):
        return [event async for event in aiter_events(response)]

    async def chunks():
        for piece in pieces:
            yield piece

    assert asyncio.run(read_all(httpx.Response(200, content=chunks()))) == CHUNKS


def test_iter_events_raises_the_error_event_after_the_events_before_it():
    text = stream_text([CHUNKS[0], {"error": {"message": "out of memory", "type": "server_error"}}])
    seen = []
    with pytest.raises(ServerError, match="out of memory"):
        for event in iter_events(httpx.Response(200, content=iter(byte_pieces(text, 5)))):
            seen.append(event)
    assert seen == [CHUNKS[0]]


def test_iter_events_raises_when_the_stream_stops_before_done():
    with pytest.raises(ServerError, match="closed it early"):
        list(iter_events(httpx.Response(200, content=iter([stream_text(CHUNKS, done=False).encode()]))))


def test_an_http_error_status_carries_the_servers_message_and_retry_after():
    body = {"error": {"message": "the server is busy", "type": "server_error", "param": None, "code": 503}}
    response = httpx.Response(503, json=body, headers={"Retry-After": "3"})
    with pytest.raises(ServerError) as raised:
        list(iter_events(response))
    assert (raised.value.status, raised.value.message, raised.value.retry_after) == (503, "the server is busy", "3")
    assert str(raised.value) == "HTTP 503: the server is busy (retry after 3 s)"

    with pytest.raises(ServerError, match="^HTTP 502: Bad gateway from the proxy$"):
        list(iter_events(httpx.Response(502, text="Bad gateway from the proxy\n")))
    with pytest.raises(ServerError, match="field required"):
        list(iter_events(httpx.Response(422, json={"detail": [{"msg": "field required"}]})))
