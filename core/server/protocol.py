"""Request bodies of the OpenAI API, validated by pydantic, with the usual extras (top_k, min_p,
repetition_penalty, ignore_eos, ...). Unknown fields are ignored, as OpenAI-compatible servers
do; fields this server cannot honour are refused by name rather than silently dropped."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from candelabra.core.requests.sampling_params import StructuredOutput

Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object: {\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint on the generated text."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationRequest(BaseModel):
    """Fields shared by chat completions and completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)  # at most the server's --max-n
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # Extras beyond OpenAI's set.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    repeat_last_n: int | None = Field(default=None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs and guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: score the prompt too

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        """A string, a list of strings, or candle-vllm's {"Single": s} / {"Multiple": [...]}."""
        if isinstance(value, dict) and len(value) == 1:
            (kind, inner), = value.items()
            if kind == "Single":
                value = inner
            elif kind == "Multiple":
                return inner
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerationRequest:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint the request puts on its text, and the field that named it;
        ConstraintError when it names more than one or one is malformed."""
        named = []
        if self.response_format is not None and self.response_format.type != "text":
            form = self.response_format
            spec = (StructuredOutput(json_object=True) if form.type == "json_object"
                    else StructuredOutput(json_schema=form.json_schema.schema_ or {}))
            named.append(("response_format", spec))
        if self.structured_outputs is not None:
            named.append(("structured_outputs", _vllm_structured_output(self.structured_outputs)))
        guided = {"guided_json": ("json_schema", _json_schema(self.guided_json, "guided_json")),
                  "guided_regex": ("regex", self.guided_regex), "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        for field_name, (kind, value) in guided.items():
            if value is not None:
                named.append((field_name, _structured(field_name, **{kind: value})))
        if len(named) > 1:
            raise ConstraintError(f"name one constraint on the output; got {', '.join(name for name, _ in named)}",
                                  named[1][0])
        return (named[0][1], named[0][0]) if named else (None, None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _vllm_structured_output(given: StructuredOutputs) -> StructuredOutput:
    fields = {"json_schema": _json_schema(given.json_, "structured_outputs.json"),
              "json_object": bool(given.json_object), "regex": given.regex, "choice": given.choice,
              "grammar": given.grammar}
    return _structured("structured_outputs", **fields)


def _field_error(field_name: str, message: str, value: Any) -> ValidationError:
    """An error located at one field, from a check that reads other fields to decide (a field's
    own validator sees only the fields declared before it)."""
    return ValidationError.from_exception_data("request", [InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=(field_name,), input=value)])


class ConstraintError(ValueError):
    def __init__(self, message: str, field_name: str) -> None:
        super().__init__(message)
        self.field_name = field_name


def _structured(field_name: str, **fields) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except ValueError as exc:
        raise ConstraintError(str(exc), field_name) from None


def _json_schema(value: dict | str | None, field_name: str) -> dict | None:
    """A JSON schema given as an object or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"is not valid JSON: {exc}", field_name) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError("must be a JSON schema object", field_name)
    return schema


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str  # JSON text, as the server answered it

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_as_json_text(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"must be a string holding the arguments as JSON, not {_json_kind(value)}; send the "
                             "arguments as the server returned them")
        return value


class HistoryToolCall(BaseModel):
    """A call in an assistant message of the history, as the server returned it."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None  # of an assistant message
    tool_call_id: str | None = Field(default=None, validate_default=True)  # of a tool message: the call it answers

    @field_validator("tool_call_id")
    @classmethod
    def _tool_results_name_their_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise ValueError('is required on a message with role "tool": the id of the call it answers')
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; send text")
        return value

    def for_template(self) -> dict:
        """The message as chat templates expect it: plain text content, known roles."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump(exclude_unset=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if "reasoning_content" in (self.model_extra or {}):
            message["reasoning_content"] = self.model_extra["reasoning_content"]
        return message


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_is_a_mode_or_a_function(cls, value: Any) -> Any:
        """Checked here so that an error names tool_choice rather than a branch of its union."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError as exc:
                raise ValueError('must be {"type": "function", "function": {"name": ...}}') from exc
        raise ValueError(f'must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}; '
                         f"got {value!r}")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_an_offered_tool(cls, value: Any, info: ValidationInfo) -> Any:
        offered = [tool.function.name for tool in info.data.get("tools") or []]
        if isinstance(value, NamedToolChoice) and value.function.name not in offered:
            raise ValueError(f"names the function {value.function.name!r}, which is not among the tools "
                             f"({', '.join(offered) or 'none were given'})")
        if value == "required" and not offered:
            raise ValueError("\"required\" needs at least one entry in tools")
        return value

    @model_validator(mode="after")
    def _refuse_legacy_functions(self) -> ChatCompletionRequest:
        for name in ("functions", "function_call"):
            if (self.model_extra or {}).get(name):
                raise ValueError(f"{name} (the deprecated form of function calling) is not supported; send tools "
                                 "and tool_choice instead")
        return self

    @property
    def tool_choice_or_default(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" when not."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(GenerationRequest):
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: only score the prompt
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a token id prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported_completion_fields(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by this server")
        for name in ("tools", "functions"):
            if (self.model_extra or {}).get(name):
                raise ValueError(f"{name} (function calling) belongs to /v1/chat/completions, not completions")
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        if self.max_tokens == 0 and not self.echo:
            raise _field_error("max_tokens", "0 generates nothing, and without echo there would be nothing to "
                               "return; set echo to get the prompt back (scored, with logprobs), or ask for at "
                               "least 1 token", self.max_tokens)
        return self

    @property
    def only_echoes(self) -> bool:
        """Whether the request only scores and returns its prompt: echo with max_tokens 0."""
        return self.echo and self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The prompt is scored for `prompt_logprobs`, and for `logprobs` when it is echoed."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted, default=None)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


# ---- embeddings and tokenizing


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings. Extras beyond OpenAI's set: `pooling` ("mean" or "last"; default: the
    server's --embedding-pooling) and `normalize` (L2-normalize each vector; default true)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "last"] | None = None
    normalize: bool = True

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("must not be empty")
        if isinstance(value, list) and any(item == "" or item == [] for item in value):
            raise ValueError("must not contain an empty string or an empty token id list")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input of the request: text, or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(item, int) for item in value):
            return [list(value)]
        return list(value)


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM names it: `prompt` text, or `messages` rendered by the chat template.
    `add_special_tokens` defaults to true for a prompt and false for messages (the template writes
    them), as in the chat and completion routes."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # offered through the template, as a chat request would
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
