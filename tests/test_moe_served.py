"""`candelabra serve` serves a tiny Mixtral from safetensors (on the numpy reference backend), a tiny
Qwen3-MoE from GGUF with Q4_0 experts (on the torch backend, which keeps them quantized), a tiny
DeepSeek-V2 from safetensors and a tiny DeepSeek-V3 from GGUF (kv_b_proj split as newer llama.cpp
converters write it), both named by candle-vllm's model-type word `deep-seek`, and the real `openai`
client gets a chat completion and a streamed completion from each. The four servers start at once and
serve the module; the models level checks each architecture from both kinds of checkpoint."""


import pytest

from candelabra.conformance.gguf_models import HF_CLASSES
from live_server import LiveServer, openai_client, started_together, write_moe_checkpoints

SERVED = [("mixtral", "safetensors"), ("qwen3moe", "gguf"), ("deepseek-v2", "safetensors"), ("deepseek-v3", "gguf")]
BACKENDS = {"safetensors": "cpu", "gguf": "torch"}
MODEL_TYPE_WORDS = {"deepseek-v2": ("deep-seek",), "deepseek-v3": ("deep-seek",)}
# Both tokenizers keep ids 0 and 1 for special tokens, which would leave no text.
NO_SPECIALS = {"logit_bias": {"0": -100, "1": -100}, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0, "max_tokens": 6, **NO_SPECIALS}
CHATS = {"safetensors": [{"role": "user", "content": "w20 w21 w22"}],
         "gguf": [{"role": "user", "content": "hello there"}]}
PROMPTS = {"safetensors": "w5 w30 w31 w6", "gguf": "one more time"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(arch, checkpoint format) -> its LiveServer."""
    root = tmp_path_factory.mktemp("moe-served")
    checkpoints = {arch: dict(zip(("safetensors", "gguf"), write_moe_checkpoints(root, arch)))
                   for arch in dict.fromkeys(arch for arch, _ in SERVED)}
    servers = {
        (arch, form): LiveServer("--weight-path", str(checkpoints[arch][form]), "--backend", BACKENDS[form],
                                 "--kvcache-mem-gpu", "2", "--kvcache-mem-cpu", "0", *MODEL_TYPE_WORDS.get(arch, ()))
        for arch, form in SERVED}
    with started_together(servers):
        yield servers


@pytest.mark.parametrize("arch, form", SERVED)
def test_a_served_moe_model_answers_a_chat(servers, arch, form):
    server = servers[arch, form]
    assert f"({HF_CLASSES[arch]}, 2 layers)" in server.startup
    reply = openai_client(server).chat.completions.create(model=server.model, messages=CHATS[form], **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    assert choice.message.role == "assistant" and choice.message.content.strip()


@pytest.mark.parametrize("arch, form", SERVED)
def test_a_served_moe_model_streams_the_completion_it_gives_whole(servers, arch, form):
    server = servers[arch, form]
    client = openai_client(server)
    whole = client.completions.create(model=server.model, prompt=PROMPTS[form], **GREEDY)
    stream = client.completions.create(model=server.model, prompt=PROMPTS[form], stream=True, **GREEDY)
    chunks = [chunk for chunk in stream if chunk.choices]
    assert len(chunks) > 1
    streamed = "".join(chunk.choices[0].text for chunk in chunks)
    assert streamed == whole.choices[0].text and streamed.strip()
    assert chunks[-1].choices[0].finish_reason == "length"
