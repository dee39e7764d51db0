"""A real `candelabra serve` in a child process, on 127.0.0.1 and a free port, serving a tiny
random model whose word-level vocabulary has thinking tags and whose chat template can open one;
and tiny MoE checkpoints, as safetensors and as GGUF, each with a tokenizer and a chat template."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from candelabra.conformance.engine_cases import write_tiny_checkpoint, write_word_tokenizer

THINK_WORDS = {"w158": "<think>", "w159": "</think>"}
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('this template takes no tool messages') }}{% endif %}"
    "{{ {'system': 'w4', 'user': 'w5', 'assistant': 'w6'}[m['role']] }} {{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}w6{% if enable_thinking %} <think>{% endif %}{% endif %}"
)


def write_chat_checkpoint(folder: Path, seed: int = 11) -> Path:
    write_tiny_checkpoint(folder, seed)
    tokenizer_file = folder / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    for word, tag in THINK_WORDS.items():
        vocab[tag] = vocab.pop(word)
    tokenizer_file.write_text(json.dumps(tokenizer))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return folder


MOE_CHAT_TEMPLATE = ("{% for m in messages %}w5 {{ m['content'] }} {% endfor %}"
                     "{% if add_generation_prompt %}w6{% endif %}")
GGUF_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"


def write_moe_checkpoints(folder: Path, arch: str) -> tuple[Path, Path]:
    """conformance's tiny random `arch` model (a MoE case of gguf_models: mixtral, qwen3moe, deepseek-v2
    or deepseek-v3) saved by transformers with a word-level tokenizer ("<unk>", "<eos>", "w2" ...) and a
    chat template, and converted to GGUF with Q4_0 weights and experts and a byte-pair tokenizer of its
    own ("<s>", "</s>", letters and pairs of them). Returns the folder and the .gguf file."""
    from gguf import GGMLQuantizationType

    from candelabra.conformance.gguf_models import convert_to_gguf, settings_of, tiny_model

    model = tiny_model(arch)
    vocab_size = settings_of(arch)["vocab_size"]
    saved = folder / arch
    model.save_pretrained(saved)
    write_word_tokenizer(saved, vocab_size)
    config_file = saved / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": MOE_CHAT_TEMPLATE}))
    gguf_file = folder / f"{arch}-q4_0.gguf"
    convert_to_gguf(model, arch, gguf_file, GGMLQuantizationType.Q4_0, metadata=byte_pair_tokenizer(vocab_size))
    return saved, gguf_file


def byte_pair_tokenizer(vocab_size: int) -> dict:
    """GGUF metadata for a GPT-2 style tokenizer of `vocab_size` tokens: "<s>" (0) and "</s>" (1), the
    letters with and without a leading space ("Ġ"), then two-letter words, each with its merge."""
    letters = [chr(code) for code in range(ord("a"), ord("z") + 1)]
    tokens = ["<s>", "</s>", "Ġ", *letters, *("Ġ" + letter for letter in letters)]
    pairs = [a + b for a in "aeiou" for b in letters][: vocab_size - len(tokens)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens + pairs,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) + len(pairs) - 2),
        "tokenizer.ggml.merges": [f"Ġ {letter}" for letter in letters] + [f"{pair[0]} {pair[1]}" for pair in pairs],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 1,
        "tokenizer.chat_template": GGUF_CHAT_TEMPLATE,
    }


class LiveServer:
    """`candelabra serve ARGS --port 0`; `.url` once it answers /health. Use as a context manager."""

    def __init__(self, *args: str, env: dict | None = None, log: Path | None = None) -> None:
        self.args, self.env, self.url, self.model = args, env, "", ""
        self.log = log
        self.process: subprocess.Popen | None = None
        self.output: list[str] = []  # what the server printed after start-up

    def __enter__(self) -> LiveServer:
        command = [sys.executable, "-m", "candelabra.core.cli", "serve", "--port", "0", *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(self.env or {})})
        lines = []
        deadline = time.monotonic() + 300
        for line in self.process.stdout:
            lines.append(line)
            found = re.match(r"serving\s+(http://\S+)", line)
            if found:
                self.url = found.group(1)
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.process.kill()
            raise RuntimeError("the server did not start:\n" + "".join(lines) + (self.process.stdout.read() or ""))
        self.startup = "".join(lines)
        self._drain_output()
        self._wait_healthy()
        self.model = httpx.get(f"{self.url}/v1/models", headers=self._auth()).json()["data"][0]["id"]
        return self

    def _auth(self) -> dict:
        key = (self.env or {}).get("CANDELABRA_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _drain_output(self) -> None:
        """Keep reading the child's output so it never blocks on a full pipe."""
        def drain():
            for line in self.process.stdout:
                self.output.append(line)

        self._drainer = threading.Thread(target=drain, daemon=True)
        self._drainer.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url}/health did not answer")

    def metric(self, name: str) -> float:
        """The value of one unlabelled-or-model-labelled sample from /metrics."""
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not in /metrics")

    def stop(self, timeout: float = 30) -> str:
        """Stop the server as a terminal's Ctrl-C does; what it printed after start-up."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=timeout)
        self._drainer.join(timeout=10)  # it ends at the end of the child's output
        return "".join(self.output)

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


@contextlib.contextmanager
def started_together(servers: dict):
    """Start every LiveServer of `servers` at once, yield the dict, and stop them all afterwards."""
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.push(server.__exit__)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(LiveServer.__enter__, servers.values()))
        yield servers


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
