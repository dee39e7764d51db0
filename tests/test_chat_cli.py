"""`candelabra chat`: its request bodies, history and display, and conversations with a live server."""

import argparse
import io
import re
import socket
import subprocess
import sys

import httpx
import pytest
from rich.console import Console

from candelabra.core.clients import chat
from candelabra.core.clients.connection import describe_failure
from candelabra.core.clients.sse_client import ServerError


def chat_args(*argv):
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_become_openai_fields_and_unset_ones_are_left_to_the_server():
    messages = [{"role": "user", "content": "hi"}]
    plain = chat.request_body("m", messages, chat_args())
    assert plain == {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True}}

    args = chat_args("--temperature", "0", "--top-p", "0.9", "--top-k", "40", "--penalty", "1.1",
                     "--max-tokens", "100", "--seed", "7", "--thinking")
    body = chat.request_body("m", messages, args)
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed")} == \
        {"temperature": 0.0, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_tokens": 100, "seed": 7}
    assert body["chat_template_kwargs"] == {"enable_thinking": True}


def test_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    from candelabra.core.clients.connection import api_headers

    monkeypatch.delenv("CANDELABRA_API_KEY", raising=False)
    assert api_headers(None) == {}
    monkeypatch.setenv("CANDELABRA_API_KEY", "from-env")
    assert api_headers(None) == {"Authorization": "Bearer from-env"}
    assert api_headers("from-flag") == {"Authorization": "Bearer from-flag"}


def test_clearing_the_conversation_keeps_the_system_prompt():
    conversation = chat.Conversation("be brief")
    conversation.add_turn("hi", "hello")
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
    conversation.clear()
    assert conversation.messages == [{"role": "system", "content": "be brief"}]
    assert chat.Conversation(None).messages == []


def test_plain_view_puts_the_answer_alone_on_stdout_and_the_thinking_apart(capsys):
    view = chat.PlainView(Console(stderr=True, highlight=False, soft_wrap=True))
    for piece in ("Let me", " think."):
        view.add_reasoning(piece)
    for piece in ("**Four**", "\tand [b]more[/b] :smile:"):
        view.add_content(piece)
    view.close(complete=True)
    out, err = capsys.readouterr()
    assert out == "**Four**\tand [b]more[/b] :smile:\n"
    assert err == "thinking:\nLet me think.\n"

    view.add_reasoning("Hm.")
    view.close(complete=True)  # a reply that only thought still ends its (empty) line on stdout
    view.add_reasoning("Cut")
    view.close(complete=False)  # a reply that failed leaves stdout alone
    assert capsys.readouterr() == ("\n", "thinking:\nHm.\nthinking:\nCut\n")


def test_reply_statistics_prefer_the_usage_count():
    reply = chat.Reply(content="abc", pieces=3, completion_tokens=6, seconds=2.0, first_token_seconds=0.25)
    assert reply.statistics() == "[6 tokens in 2.00 s, 3.0 tok/s, first token after 0.25 s]"
    assert chat.Reply(pieces=3, seconds=1.0).statistics() == "[3 tokens in 1.00 s, 3.0 tok/s]"


def test_url_may_be_given_openai_style():
    from candelabra.core.clients.connection import server_root

    for url in ("http://h:2000", "http://h:2000/", "http://h:2000/v1", "http://h:2000/v1/"):
        assert server_root(url) == "http://h:2000"


@pytest.mark.parametrize("flag", ["--top-k", "--max-tokens", "--seed"])
def test_integer_flags_refuse_other_values(flag):
    with pytest.raises(SystemExit):
        chat_args(flag, "1.5")


NO_SERVER_HINT = "is a server running there? start one with `candelabra serve`, or pass --url"


def test_failures_are_described_in_one_line_with_where():
    url = "http://h:1/v1/chat/completions"
    assert describe_failure(ServerError("invalid API key", status=401), url) == \
        f"{url} answered HTTP 401: invalid API key (pass --api-key or set CANDELABRA_API_KEY)"
    assert describe_failure(ServerError("engine died", in_stream=True), url) == f"{url} failed mid-stream: engine died"
    assert describe_failure(ServerError("no model"), url) == f"{url}: no model"
    assert describe_failure(httpx.ConnectError("refused"), url) == \
        f"cannot connect to {url}: refused ({NO_SERVER_HINT})"


GREEDY = ("--temperature", "0", "--max-tokens", "8")


def direct_message(server, messages, **fields):
    """The greedy reply the API gives to the whole conversation at once, without streaming."""
    body = {"model": server.model, "messages": messages, "temperature": 0, "max_tokens": 8, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]


def direct_reply(server, messages):
    return direct_message(server, messages)["content"]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def chat_with_piped_stdin(monkeypatch, capsys, lines, *argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code = chat.run(chat_args(*argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_piped_chat_prints_the_apis_replies_and_clear_forgets(live_server, monkeypatch, capsys):
    code, out, err = chat_with_piped_stdin(monkeypatch, capsys, "w1 w2\n/clear\n\nw3\n", "--url", live_server.url,
                                           *GREEDY)
    assert code == 0, err
    first, after_clear = direct_reply(live_server, [user("w1 w2")]), direct_reply(live_server, [user("w3")])
    assert out == f"{first}\n{after_clear}\n"
    assert "conversation cleared" in err
    statistics = re.compile(r"\[\d+ tokens in [\d.]+ s, [\d.]+ tok/s, first token after [\d.]+ s\]")
    assert sum(bool(statistics.fullmatch(line)) for line in err.splitlines()) == 2


def test_piped_chat_keeps_the_conversation_and_the_system_prompt(live_server, monkeypatch, capsys):
    code, out, err = chat_with_piped_stdin(monkeypatch, capsys, "w1 w2\nw3\n/quit\nw4\n", "--url", live_server.url,
                                           "--model", live_server.model, "--system", "w9 w8", *GREEDY)
    assert code == 0, err
    system = {"role": "system", "content": "w9 w8"}
    first = direct_reply(live_server, [system, user("w1 w2")])
    second = direct_reply(live_server, [system, user("w1 w2"), assistant(first), user("w3")])
    assert out == f"{first}\n{second}\n"  # and nothing for the line after /quit
    assert second != direct_reply(live_server, [system, user("w3")])  # the history made a difference


def test_a_refused_message_leaves_the_conversation_as_it_was(live_server, monkeypatch, capsys):
    context = httpx.get(f"{live_server.url}/v1/models").json()["data"][0]["max_model_len"]
    too_long = " ".join(["w5"] * (context + 1))
    code, out, err = chat_with_piped_stdin(monkeypatch, capsys, f"w1 w2\n{too_long}\nw3\n", "--url",
                                           live_server.url, *GREEDY)
    assert code == 1
    first = direct_reply(live_server, [user("w1 w2")])
    assert out == f"{first}\n{direct_reply(live_server, [user('w1 w2'), assistant(first), user('w3')])}\n"
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {live_server.url}/v1/chat/completions answered HTTP 400: ")


def unused_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_chat_without_a_server_fails_in_one_line(monkeypatch, capsys):
    url = unused_url()
    code, out, err = chat_with_piped_stdin(monkeypatch, capsys, "w1\n", "--url", url)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"error: cannot connect to {url}: ")
    assert err.endswith(f" ({NO_SERVER_HINT})\n")


def test_the_chat_command_without_a_server_says_to_start_one():
    url = unused_url()
    done = subprocess.run([sys.executable, "-m", "candelabra.core.cli", "chat", "--url", url],
                          input="w1\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: cannot connect to {url}: ") and "Connection refused" in line
    assert line.endswith(f" ({NO_SERVER_HINT})")


def test_thinking_is_shown_apart_from_the_answer(live_server, monkeypatch, capsys):
    code, out, err = chat_with_piped_stdin(monkeypatch, capsys, "w1 w2\n", "--url", live_server.url, "--thinking",
                                           *GREEDY)
    assert code == 0, err
    message = direct_message(live_server, [user("w1 w2")], chat_template_kwargs={"enable_thinking": True})
    assert message["reasoning_content"]  # the template opened <think>, so the tiny model's words are thinking
    assert out == f"{message['content']}\n"
    assert f"thinking:\n{message['reasoning_content']}\n" in err


def test_the_chat_command_reads_piped_stdin(live_server):
    done = subprocess.run([sys.executable, "-m", "candelabra.core.cli", "chat", "--url", live_server.url, *GREEDY],
                          input="w1 w2\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == direct_reply(live_server, [user("w1 w2")]) + "\n"
