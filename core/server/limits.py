"""What one request may ask of the server. Each bound is a `candelabra serve` flag with a default, and
is checked before the request's work is queued, and before any tokenizing beyond what the check itself
needs: a request over a bound gets a 400 that names the bound and its flag, and costs the server
nothing else. The tokens of one input are bounded by the context (--max-model-len) as before."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from candelabra.core.server.errors import APIError, bad_request


@dataclass(frozen=True)
class RequestLimits:
    # Inputs of one embeddings request, prompts of one completions request: OpenAI's embeddings bound.
    max_inputs: int = 2048
    # Prompt tokens of one request, its inputs or prompts together: OpenAI's bound on one embeddings request.
    max_request_tokens: int = 300_000
    max_n: int = 128  # samples of one prompt (n, and best_of, which must equal it): OpenAI's bound
    max_stop: int = 16  # stop strings
    max_logit_bias: int = 1024  # logit_bias entries
    max_tools: int = 128  # functions in a tool list: OpenAI's bound

    def check_count(self, count: int, limit_name: str, param: str, what: str) -> None:
        """A 400 where `count` items of `param` exceed the bound `limit_name`."""
        limit = getattr(self, limit_name)
        if count > limit:
            raise bad_request(f"{param} has {count} {what}; this server takes at most {limit} in one request "
                              f"({flag_of(limit_name)} sets it)", param)

    def check_generation(self, request) -> None:
        """A 400 where a chat or completions request asks for more samples, stop strings, logit_bias entries
        or tools than the bounds allow."""
        best_of = (request.model_extra or {}).get("best_of")
        for value, limit_name, param in ((request.n, "max_n", "n"), (best_of, "max_n", "best_of")):
            limit = getattr(self, limit_name)
            if isinstance(value, int) and value > limit:
                raise bad_request(f"{param} is {value}; this server takes at most {limit} samples of a prompt "
                                  f"({flag_of(limit_name)} sets it)", param)
        self.check_count(len(request.stop or []), "max_stop", "stop", "strings")
        self.check_count(len(request.logit_bias or {}), "max_logit_bias", "logit_bias", "entries")
        self.check_count(len(getattr(request, "tools", None) or []), "max_tools", "tools", "functions")

    def token_counter(self, param: str) -> TokenCounter:
        return TokenCounter(self.max_request_tokens, param)


class TokenCounter:
    """Adds up the prompt tokens of one request as its inputs are tokenized, one by one, and stops the
    request at the first input that takes the sum past the bound."""

    def __init__(self, limit: int, param: str) -> None:
        self.limit, self.param, self.total = limit, param, 0

    def add(self, count: int, label: str | None = None) -> None:
        """Count the tokens of the next input (`label` in the message: input[7], ...)."""
        self.total += count
        if self.total > self.limit:
            where = f" with {label}" if label else ""
            raise APIError(400, f"{self.param} passes {self.limit} prompt tokens{where}; this server takes at most "
                                f"{self.limit} in one request ({flag_of('max_request_tokens')} sets it)", self.param,
                           "context_length_exceeded")


_HELP = {
    "max_inputs": "inputs of one embeddings request, and prompts of one completions request",
    "max_request_tokens": "prompt tokens of one request, all its inputs or prompts together",
    "max_n": "samples of one prompt a request may ask for (n, and best_of)",
    "max_stop": "stop strings of one request",
    "max_logit_bias": "logit_bias entries of one request",
    "max_tools": "functions in one request's tool list",
}
_FLAGS = {"max_inputs": "--max-request-inputs", "max_request_tokens": "--max-request-tokens",
          "max_n": "--max-n", "max_stop": "--max-stop-strings", "max_logit_bias": "--max-logit-bias",
          "max_tools": "--max-tools"}


def flag_of(limit_name: str) -> str:
    return _FLAGS[limit_name]


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (a request over one gets a 400 naming it)")
    for field in fields(RequestLimits):
        group.add_argument(_FLAGS[field.name], dest=f"limit_{field.name}", type=int, default=field.default,
                           metavar="N", help=f"{_HELP[field.name]}, at most (default {field.default:,})")


def limits_from_arguments(args: argparse.Namespace) -> RequestLimits:
    """The limits the flags set; ValueError naming the flag for a value below 1."""
    values = {field.name: getattr(args, f"limit_{field.name}") for field in fields(RequestLimits)}
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{_FLAGS[name]} must be at least 1, not {value}")
    return RequestLimits(**values)
