"""What the HTTP clients (`candelabra chat` and `candelabra bench`) share: the flags naming the server, the API
key header, the served model, and one-line descriptions of what went wrong."""

from __future__ import annotations

import argparse
import os

import httpx

from candelabra.core.clients.sse_client import ServerError, check_status

DEFAULT_URL = "http://127.0.0.1:2000"
API_KEY_VARIABLE = "CANDELABRA_API_KEY"
# A reply may wait long in the server's queue, but five silent minutes mean the server is stuck.
STREAM_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's base URL (default: %(default)s)")
    parser.add_argument("--model", metavar="NAME",
                        help="the model to ask (default: the first the server lists at /v1/models)")
    parser.add_argument("--api-key", metavar="KEY", help=f"sent as a bearer token (default: ${API_KEY_VARIABLE})")


def server_root(url: str) -> str:
    """The base URL without a trailing slash or /v1, so both http://host:2000 and OpenAI-style
    http://host:2000/v1/ work."""
    root = url.strip().rstrip("/")
    return root.removesuffix("/v1")


def api_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get(API_KEY_VARIABLE)
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(client: httpx.Client, root: str) -> str:
    """The first model the server lists."""
    response = client.get(f"{root}/v1/models")
    check_status(response)
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        raise ServerError(f"the server lists no model at /v1/models: {response.text[:200]!r}") from None


def describe_failure(error: Exception, url: str) -> str:
    """One line saying what failed, and where."""
    if isinstance(error, ServerError) and error.in_stream:
        return f"{url} failed mid-stream: {error.message}"
    if isinstance(error, ServerError) and error.status is not None:
        hint = f" (pass --api-key or set {API_KEY_VARIABLE})" if error.status == 401 else ""
        return f"{url} answered {error}{hint}"
    if isinstance(error, ServerError):
        return f"{url}: {error.message}"
    if isinstance(error, httpx.ConnectError):
        hint = "is a server running there? start one with `candelabra serve`, or pass --url"
        return f"cannot connect to {url}: {error} ({hint})"
    if isinstance(error, httpx.TimeoutException):
        return f"{url} did not answer in time ({type(error).__name__})"
    if isinstance(error, httpx.HTTPError):
        return f"the connection to {url} failed: {error}"
    return f"{url}: {error!r}"
