"""Structured output: a request's JSON schema, regex, choice or grammar constrains sampling through
the allowed-token mask (checked on every backend by op conformance's `sample` cases), offline and
through the OpenAI API, with the real openai client and langchain against the default model."""

import json
import re

import httpx
import numpy as np
import openai
import pytest

from candelabra.core.requests.sampling_params import SamplingParams, StructuredOutput
from candelabra.core.server.protocol import ChatCompletionRequest, ConstraintError
from support import available_backends

CHOICES = ["yes", "no", "maybe not"]


# ---- the request's constraint, as the API spells it


def _constraint(**fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields).structured_output()


def test_each_spelling_gives_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _constraint() == (None, None)
    assert _constraint(response_format={"type": "text"}) == (None, None)
    assert _constraint(response_format={"type": "json_object"}) == (StructuredOutput(json_object=True),
                                                                     "response_format")
    assert _constraint(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                               "strict": True}}) == (
        StructuredOutput(json_schema=schema), "response_format")
    assert _constraint(guided_json=json.dumps(schema)) == (StructuredOutput(json_schema=schema), "guided_json")
    assert _constraint(guided_regex="a+") == (StructuredOutput(regex="a+"), "guided_regex")
    assert _constraint(guided_choice=["x", "y"]) == (StructuredOutput(choice=("x", "y")), "guided_choice")
    assert _constraint(structured_outputs={"grammar": "start: \"a\""}) == (
        StructuredOutput(grammar="start: \"a\""), "structured_outputs")
    assert _constraint(structured_outputs={"json": schema}) == (StructuredOutput(json_schema=schema),
                                                                "structured_outputs")


@pytest.mark.parametrize("fields, field_name", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_conflicting_or_malformed_constraints_name_their_field(fields, field_name):
    with pytest.raises(ConstraintError) as caught:
        _constraint(**fields)
    assert caught.value.field_name == field_name


# ---- the engine, on every backend


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """Random weights for a tiny Llama, with the byte-level stand-in tokenizer: every text is
    spelt in bytes, so a random model's samples reach any string the constraint allows."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


@pytest.mark.parametrize("backend", available_backends())
def test_random_samples_of_a_random_model_keep_to_the_constraint(tiny_model, tiny_llm, backend):
    llm = tiny_llm(folder=tiny_model, load_format="dummy", backend=backend)
    choice = SamplingParams(n=6, temperature=1.5, seed=3, max_tokens=12, ignore_eos=True,
                            structured_output=StructuredOutput(choice=CHOICES))
    regex = SamplingParams(n=4, temperature=1.5, seed=4, max_tokens=8, ignore_eos=True,
                           structured_output=StructuredOutput(regex=r"(ab|c)+d"))
    free = SamplingParams(n=4, temperature=1.5, seed=3, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([[5, 9, 23], [42, 7, 11, 13], [5, 9, 23]], [choice, regex, free], progress=False)
    chosen = [o.text for o in outputs[0].outputs]
    assert all(text in CHOICES for text in chosen), chosen
    assert len(set(chosen)) > 1, "six draws at temperature 1.5 all took the same choice"
    # A completed choice ends the sample with "stop" even though its end token is ignored.
    assert all(o.finish_reason == "stop" for o in outputs[0].outputs)
    for o in outputs[1].outputs:
        # the regex ends the sample as soon as it is complete, or max_tokens cuts it short
        complete = o.finish_reason == "stop"
        pattern = r"(ab|c)+d" if complete else r"(ab|c)*a?"
        assert re.fullmatch(pattern, o.text) and (complete or len(o.token_ids) == 8), (o.text, o.finish_reason)
    # The unconstrained rows beside them sample as they do alone.
    alone = llm.generate([[5, 9, 23]], free, progress=False)[0]
    assert [o.token_ids for o in outputs[2].outputs] == [o.token_ids for o in alone.outputs]


def test_an_invalid_constraint_is_refused_when_the_request_is_checked(tiny_model, tiny_llm):
    llm = tiny_llm(folder=tiny_model, load_format="dummy")
    for spec, says in [(StructuredOutput(regex="(a"), "invalid regex"),
                       (StructuredOutput(json_schema={"type": "nonsense"}), "invalid json_schema"),
                       (StructuredOutput(grammar="start: missing_rule"), "invalid grammar"),
                       (StructuredOutput(grammar="root ::= ("), "invalid grammar")]:
        with pytest.raises(ValueError, match=says):
            llm.engine.check_request([5, 9], SamplingParams(structured_output=spec))
    assert not llm.engine.has_unfinished_requests()


def test_the_mask_reaches_sampling_for_constrained_rows_only(tiny_model, tiny_llm):
    from candelabra.core.worker.sampling_inputs import sampling_metadata

    llm = tiny_llm(folder=tiny_model, load_format="dummy")
    engine = llm.engine
    engine.add_request("constrained", [5, 9], SamplingParams(structured_output=StructuredOutput(choice=["xy"])))
    engine.add_request("free", [5, 9], SamplingParams())
    seqs = [r.sequences[0] for r in engine.requests.values()]
    meta = sampling_metadata(seqs)
    allowed = np.unpackbits(meta.allowed_token_mask.view(np.uint8), axis=1, bitorder="little")
    assert meta.allowed_token_mask.shape == (2, 300 // 32 + 1)
    assert np.flatnonzero(allowed[0]).tolist() == engine.tokenizer.encode("x", add_special_tokens=False)
    assert allowed[1].all()
    assert sampling_metadata(seqs[1:]).allowed_token_mask is None


# ---- the API, against the default model


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
                   "population": {"type": "integer", "minimum": 0},
                   "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1,
                                 "maxItems": 2}},
    "required": ["city", "country", "population", "landmarks"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me facts about Paris as JSON."}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _follows_schema(value: dict) -> None:
    assert set(value) == set(SCHEMA["required"])
    assert isinstance(value["city"], str) and isinstance(value["country"], str)
    assert isinstance(value["population"], int) and value["population"] >= 0
    assert len(value["city"]) <= 30 and len(value["country"]) <= 30
    assert 1 <= len(value["landmarks"]) <= 2 and all(isinstance(item, str) for item in value["landmarks"])


@pytest.mark.slow
def test_json_schema_with_the_openai_client(client, server):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model=server.model, messages=ASK, response_format=response_format,
                                           temperature=0, max_tokens=120)
    assert reply.choices[0].finish_reason == "stop"
    _follows_schema(json.loads(reply.choices[0].message.content))
    # Sampled, streamed, several at once: every one parses.
    stream = client.chat.completions.create(model=server.model, messages=ASK, response_format=response_format,
                                            temperature=1.0, seed=5, n=3, max_tokens=150, stream=True)
    texts = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        _follows_schema(json.loads(text))


@pytest.mark.slow
def test_json_object_and_the_vllm_extras(client, server):
    short = [{"role": "user", "content": "The capital of France and its country, as a JSON object with the keys "
                                         "name and country."}]
    reply = client.chat.completions.create(model=server.model, messages=short, temperature=0, max_tokens=60,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    yes_no = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    reply = client.chat.completions.create(model=server.model, messages=yes_no, temperature=0, max_tokens=5,
                                           extra_body={"structured_outputs": {"choice": ["Yes", "No"]}})
    assert reply.choices[0].message.content in ("Yes", "No")
    completion = client.completions.create(model=server.model, prompt="The year the Eiffel Tower opened:",
                                           temperature=0, max_tokens=10,
                                           extra_body={"guided_regex": r" [12][0-9]{3}\."})
    assert re.fullmatch(r" [12][0-9]{3}\.", completion.choices[0].text)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    reply = client.chat.completions.create(model=server.model, messages=yes_no, temperature=0, max_tokens=12,
                                           extra_body={"guided_grammar": grammar})
    assert reply.choices[0].message.content in ("The answer is yes.", "The answer is no.")


@pytest.mark.slow
def test_langchain_structured_output_fills_the_model_in_json_schema_and_json_mode(server):
    """The schema bounds every field, so whatever the quantized model's greedy path (its kernels are chosen by
    timing, and one choice ran a new key on past any length), json_schema mode ends within max_tokens. JSON
    mode sends no schema: its reply is a JSON object, or the start of one where the model ran on to the length
    limit (which LangChain raises as LengthFinishReasonError), and what LangChain makes of it is the model's
    doing."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    class City(BaseModel):
        """Facts about a city."""

        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population: int = Field(ge=0, le=10**10)

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=server.model, temperature=0,
                      max_tokens=120, max_retries=0)
    ask = "Give me facts about Paris as JSON with the keys city, country and population."
    facts = chat.with_structured_output(City, method="json_schema").invoke(ask)
    assert isinstance(facts, City) and facts.city
    try:
        answer = chat.with_structured_output(City, method="json_mode", include_raw=True).invoke(ask)
    except openai.LengthFinishReasonError as stopped:  # LangChain's way of saying the reply ran to the limit
        assert stopped.completion.choices[0].message.content.lstrip().startswith("{"), stopped.completion
        return
    assert answer["raw"].response_metadata["finish_reason"] == "stop", answer
    content = json.loads(answer["raw"].content)
    assert isinstance(content, dict), answer
    try:
        expected = City.model_validate(content)
    except ValidationError:
        expected = None  # the model's keys, not City's: LangChain reports a parsing error
    assert answer["parsed"] == expected, answer


@pytest.mark.slow
@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "name one constraint"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "invalid grammar"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, says):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": ASK, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    # Nothing was lost: the server still answers.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_min_tokens_and_ignore_eos_hold_while_the_grammar_allows_more(tiny_model, tiny_llm):
    llm = tiny_llm(folder=tiny_model, load_format="dummy")
    free_end = StructuredOutput(regex="[a-c]+")
    held = [SamplingParams(n=4, temperature=1.5, seed=8, max_tokens=6, min_tokens=6, structured_output=free_end),
            SamplingParams(n=4, temperature=1.5, seed=9, max_tokens=6, ignore_eos=True, structured_output=free_end)]
    for output in llm.generate([[5, 9, 23], [5, 9, 23]], held, progress=False):
        for o in output.outputs:
            assert len(o.token_ids) == 6 and re.fullmatch("[a-c]{6}", o.text), (o.text, o.token_ids)
    # Where the grammar allows nothing but its end, it ends, min_tokens or not.
    done = llm.generate([[5, 9]], SamplingParams(min_tokens=5, max_tokens=8, ignore_eos=True,
                                                 structured_output=StructuredOutput(choice=["ab"])), progress=False)
    assert done[0].outputs[0].text == "ab" and done[0].outputs[0].finish_reason == "stop"
