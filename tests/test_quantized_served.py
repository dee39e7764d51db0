"""`candelabra serve` serves a tiny GPTQ checkpoint (act-order, v1 zero points), a tiny AWQ checkpoint
and a dense checkpoint quantized at load (`--isq q4k`, and candle-vllm's spelling `--quant q4k`), each
on the numpy reference backend (which dequantizes at load) and on the torch backend (which keeps the
formats; once more with activations rounded to int8, `CANDELABRA_INT8_ACTIVATIONS=1`), and the real
`openai` client gets a chat completion and a streamed completion from each. The seven servers start at
once and serve the module."""

import json

import pytest

from candelabra.conformance.engine_cases import write_word_tokenizer
from candelabra.conformance.model_cases import ISQ_MODEL, VOCAB, ModelCase, make_reference
from candelabra.conformance.quantized_checkpoints import Int4Layout, write_int4_copy
from live_server import LiveServer, openai_client, started_together

CHAT_TEMPLATE = "{% for m in messages %}w5 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w6{% endif %}"
# checkpoint -> the flags that serve it, by backend
SERVED = {
    ("gptq", "cpu"): ("--quant", "gptq"), ("gptq", "torch"): ("--quant", "marlin"),
    ("awq", "cpu"): ("--quant", "awq"), ("awq", "torch"): (),
    ("dense", "cpu"): ("--isq", "q4k"), ("dense", "torch"): ("--quant", "q4k"),
}
# The dense checkpoint quantized at load on the torch backend, its kernels free to round x to int8
INT8 = ("dense", "torch", "int8 activations")
SERVERS = [*SERVED, INT8]
# The in-situ quantization case's shapes as a Llama: transformers reads a word-level tokenizer beside a
# Qwen2 config as Qwen2's byte-pair tokenizer, which finds no words in it.
SERVED_MODEL = ModelCase("llama-isq", "LlamaConfig", ISQ_MODEL.settings)
GREEDY = {"temperature": 0, "max_tokens": 6, "logit_bias": {"0": -100, "1": -100}, "extra_body": {"ignore_eos": True}}


def write_checkpoints(root):
    """A dense Llama whose linears are whole Q4_K super-blocks but for the MLP's down projection (288
    features, which takes Q8_0), with a word-level tokenizer and a chat template; and GPTQ and AWQ
    copies of it."""
    dense = root / "dense"
    make_reference(SERVED_MODEL, seed=5).save_pretrained(dense)
    write_word_tokenizer(dense, VOCAB)
    config_file = dense / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    gptq = write_int4_copy(dense, root / "gptq", Int4Layout("gptq", 32, desc_act=True, v1=True), seed=5)
    awq = write_int4_copy(dense, root / "awq", Int4Layout("awq", 32), seed=5)
    return {"dense": dense, "gptq": gptq, "awq": awq}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(checkpoint, backend) -> its LiveServer, and INT8 -> the torch server with int8 activations allowed."""
    checkpoints = write_checkpoints(tmp_path_factory.mktemp("quantized-served"))
    servers = {
        (name, backend): LiveServer("--weight-path", str(checkpoints[name]), "--backend", backend, *flags,
                                    "--kvcache-mem-gpu", "2", "--kvcache-mem-cpu", "0")
        for (name, backend), flags in SERVED.items()}
    servers[INT8] = LiveServer("--weight-path", str(checkpoints["dense"]), "--backend", "torch",
                               *SERVED["dense", "torch"], "--kvcache-mem-gpu", "2", "--kvcache-mem-cpu", "0",
                               env={"CANDELABRA_INT8_ACTIVATIONS": "1"})
    with started_together(servers):
        yield servers


@pytest.mark.parametrize("served", SERVERS, ids="-".join)
def test_a_served_quantized_checkpoint_answers_a_chat(servers, served):
    server = servers[served]
    reply = openai_client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "w20 w21 w22"}], **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    assert choice.message.role == "assistant" and len(choice.message.content.split()) == 6


@pytest.mark.parametrize("served", SERVERS, ids="-".join)
def test_a_served_quantized_checkpoint_streams_the_completion_it_gives_whole(servers, served):
    server = servers[served]
    client = openai_client(server)
    whole = client.completions.create(model=server.model, prompt="w5 w30 w31 w6", **GREEDY)
    stream = client.completions.create(model=server.model, prompt="w5 w30 w31 w6", stream=True, **GREEDY)
    chunks = [chunk for chunk in stream if chunk.choices]
    streamed = "".join(chunk.choices[0].text for chunk in chunks)
    assert len(chunks) > 1 and streamed == whole.choices[0].text and streamed.strip()


def test_the_start_up_log_says_how_the_weights_were_quantized(servers):
    isq = servers["dense", "cpu"].startup + servers["dense", "torch"].startup
    assert isq.count("in-situ quantization to Q4_K") == 2, isq
    assert "GPTQ" in servers["gptq", "cpu"].startup and "AWQ" in servers["awq", "torch"].startup


def test_int8_activations_are_said_at_start_up_and_their_rows_read(servers):
    assert "x rounded to int8 before quantized products" in servers[INT8].startup
    assert "rounded to int8" not in servers["dense", "torch"].startup
    assert "x rounded to int8 where a kernel does" in servers[INT8].startup
