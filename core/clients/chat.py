"""`candelabra chat`: a terminal chat with a running server, streaming each reply.

With stdin not a terminal, each line read is one user message and stdout gets only the replies, one after
another, each ended by a newline; everything else (thinking, statistics, notices) goes to stderr."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.text import Text

from candelabra.core.clients.connection import (
    STREAM_TIMEOUT,
    add_server_arguments,
    api_headers,
    describe_failure,
    served_model,
    server_root,
)
from candelabra.core.clients.sse_client import ServerError, iter_events

EXIT_COMMANDS = ("/exit", "/quit")
CLEAR_COMMAND = "/clear"
THINKING_STYLE = "dim italic"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--system", metavar="PROMPT", help="system prompt that opens every conversation")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling threshold")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the k likeliest tokens")
    parser.add_argument("--penalty", type=float, metavar="P", help="repetition penalty (1 = none)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="longest reply, in tokens (default: the server's)")
    parser.add_argument("--seed", type=int, metavar="N", help="seed for sampling, to repeat a reply")
    parser.add_argument("--thinking", action="store_true",
                        help="ask a reasoning model to think before answering (chat_template_kwargs.enable_thinking)")
    parser.add_argument("--live", action="store_true", help="render each reply as live-updating Markdown")


def run(args: argparse.Namespace) -> int:
    root = server_root(args.url)
    interactive = sys.stdin.isatty()
    notices = Console(stderr=True, highlight=False, soft_wrap=True)
    with httpx.Client(headers=api_headers(args.api_key), timeout=STREAM_TIMEOUT) as client:
        try:
            model = args.model or served_model(client, root)
        except (ServerError, httpx.HTTPError) as error:
            notices.print(f"error: {describe_failure(error, root)}", style="bold red", markup=False)
            return 1
        if interactive:
            _enable_line_editing()
            notices.print(f"Chatting with {model} at {root}. {CLEAR_COMMAND} forgets the conversation, "
                          f"{' or '.join(EXIT_COMMANDS)} or Ctrl-D leaves.", style="dim", markup=False)
        live = args.live and interactive and Console().is_terminal
        return _chat_loop(client, f"{root}/v1/chat/completions", model, args, notices, interactive, live)


def _chat_loop(client: httpx.Client, url: str, model: str, args: argparse.Namespace, notices: Console,
               interactive: bool, live: bool) -> int:
    history = Conversation(args.system)
    server_failed = False
    for line in _user_lines(interactive, notices):
        if line in EXIT_COMMANDS:
            break
        if line == CLEAR_COMMAND:
            history.clear()
            notices.print("(conversation cleared)", style="dim")
            continue
        messages = [*history.messages, {"role": "user", "content": line}]
        view = LiveView() if live else PlainView(notices)
        try:
            reply = stream_reply(client, url, request_body(model, messages, args), view)
        except KeyboardInterrupt:
            notices.print("\n(reply interrupted; it is left out of the conversation)", style="yellow")
            continue
        except ServerError as error:
            # The server refused this message; the conversation so far stays as it was.
            notices.print(f"error: {describe_failure(error, url)}", style="bold red", markup=False)
            server_failed = True
            continue
        except httpx.HTTPError as error:
            notices.print(f"error: {describe_failure(error, url)}", style="bold red", markup=False)
            return 1
        history.add_turn(line, reply.content)
        notices.print(reply.statistics(), style="dim", markup=False)
    return 1 if server_failed else 0


class Conversation:
    """The messages sent with each request: the system prompt, then every completed turn."""

    def __init__(self, system_prompt: str | None):
        self.system_prompt = system_prompt
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def add_turn(self, user_text: str, reply_text: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply_text}]


def request_body(model: str, messages: list[dict], args: argparse.Namespace) -> dict:
    body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    optional = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "repetition_penalty": args.penalty, "max_tokens": args.max_tokens, "seed": args.seed}
    body.update({name: value for name, value in optional.items() if value is not None})
    if args.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    return body


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    pieces: int = 0
    completion_tokens: int | None = None
    seconds: float = 0.0
    first_token_seconds: float | None = None

    def statistics(self) -> str:
        tokens = self.completion_tokens if self.completion_tokens is not None else self.pieces
        rate = tokens / self.seconds if self.seconds > 0 else 0.0
        first = f", first token after {self.first_token_seconds:.2f} s" if self.first_token_seconds is not None else ""
        return f"[{tokens} tokens in {self.seconds:.2f} s, {rate:.1f} tok/s{first}]"


def stream_reply(client: httpx.Client, url: str, body: dict, view: PlainView | LiveView) -> Reply:
    """Streams one reply into `view`, and closes the view however the stream ends."""
    reply = Reply()
    start = time.perf_counter()
    complete = False
    try:
        with client.stream("POST", url, json=body) as response:
            for event in iter_events(response):
                if event.get("usage"):
                    reply.completion_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    reasoning, content = delta.get("reasoning_content"), delta.get("content")
                    if (reasoning or content) and reply.first_token_seconds is None:
                        reply.first_token_seconds = time.perf_counter() - start
                    if reasoning:
                        reply.reasoning += reasoning
                        reply.pieces += 1
                        view.add_reasoning(reasoning)
                    if content:
                        reply.content += content
                        reply.pieces += 1
                        view.add_content(content)
        complete = True
    finally:
        reply.seconds = time.perf_counter() - start
        view.close(complete)
    return reply


class PlainView:
    """A reply as plain streamed text: the answer on stdout, the thinking on stderr under a label."""

    def __init__(self, notices: Console):
        self.notices = notices
        self.thinking = False
        self.answering = False

    def add_reasoning(self, text: str) -> None:
        if not self.thinking:
            self.notices.print("thinking:", style="dim bold")
            self.thinking = True
        self.notices.out(text, style=THINKING_STYLE, highlight=False, end="")

    def add_content(self, text: str) -> None:
        if self.thinking and not self.answering:
            self.notices.out("")
        self.answering = True
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self, complete: bool) -> None:
        """Ends the lines begun; a complete reply always ends its line on stdout, even an empty answer."""
        if self.thinking and not self.answering:
            self.notices.out("")
        if self.answering or complete:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.thinking = self.answering = False


class LiveView:
    """A reply rendered as Markdown that updates as it streams, the thinking dimmed above it."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.live = Live(Text(""), console=Console(), refresh_per_second=10, vertical_overflow="visible")
        self.live.start()

    def add_reasoning(self, text: str) -> None:
        self.reasoning += text
        self._update()

    def add_content(self, text: str) -> None:
        self.content += text
        self._update()

    def _update(self) -> None:
        parts = []
        if self.reasoning:
            parts += [Text("thinking:", style="dim bold"), Text(self.reasoning, style=THINKING_STYLE), Text("")]
        parts.append(Markdown(self.content))
        self.live.update(Group(*parts))

    def close(self, complete: bool) -> None:
        self.live.stop()


def _user_lines(interactive: bool, notices: Console) -> Iterator[str]:
    """The user's messages, blank lines skipped, until end of input (or Ctrl-C at the prompt)."""
    try:
        while True:
            if interactive:
                notices.print()
                line = notices.input(Text("you> ", style="bold green"))
            else:
                line = sys.stdin.readline()
                if not line:
                    return
            if line.strip():
                yield line.strip()
    except (EOFError, KeyboardInterrupt):
        if interactive:
            notices.print()


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (importing it gives input() history and editing)
    except ImportError:
        pass
