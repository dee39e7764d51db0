"""`candelabra serve` with no model flag serves the default model (Qwen2.5-Coder-0.5B-Instruct from
the PyPI chunks), and answers a chat sensibly on every available backend."""

import httpx
import openai
import pytest

from live_server import LiveServer
from support import available_backends

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.mark.slow
@pytest.mark.parametrize("backend", available_backends())
def test_the_default_model_answers_a_chat(backend):
    with LiveServer("--backend", backend, "--kvcache-mem-gpu", "64", "--kvcache-mem-cpu", "0") as server:
        assert "Qwen2.5-Coder-0.5B-Instruct (Qwen2ForCausalLM, 24 layers)" in server.startup
        assert f"backend   {backend}" in server.startup
        assert server.model == "Qwen2.5-Coder-0.5B-Instruct"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=server.model, messages=QUESTION, temperature=0, max_tokens=8)
        assert "Paris" in reply.choices[0].message.content
        # The same request as plain JSON over HTTP, as curl sends it, streamed.
        body = {"messages": QUESTION, "temperature": 0, "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "Paris" in "".join(events)
