"""`candelabra serve`: load the model, start the engine, and serve the OpenAI API on uvicorn.

Flags keep candle-vllm's names; its model-type word (llama3, qwen2, ...) may follow them and is
checked against the checkpoint's own architecture.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from candelabra.core.dtypes import FLOAT_DTYPES

log = logging.getLogger("candelabra")

DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32",
                 **{name: name for name in FLOAT_DTYPES}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_type", nargs="?", metavar="MODEL_TYPE",
                        help="candle-vllm's model-type word (llama3, qwen2, gemma3, ...), checked against the "
                             "checkpoint; optional, the checkpoint's config names its architecture")
    where = parser.add_argument_group("model (none given: the default model, Qwen2.5-Coder-0.5B-Instruct)")
    where.add_argument("--weight-path", help="checkpoint folder (safetensors, or one .gguf) or a .gguf file")
    where.add_argument("--weight-file", help="a file in --weight-path (or on its own), e.g. a .gguf")
    where.add_argument("--model-id", help="ORG/NAME of a model in the local Hugging Face cache")
    where.add_argument("--revision", help="revision of --model-id")
    where.add_argument("--served-model-name", help="the name clients use (default: from the checkpoint)")
    where.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), help="compute dtype (default: the backend's first)")
    where.add_argument("--quant", help="weight format; only gguf (a .gguf checkpoint, dequantized at load) so far")

    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to expose; default 127.0.0.1)")
    net.add_argument("--port", type=int, default=2000, help="port (0 picks a free one; default 2000)")
    net.add_argument("--api-key", default=os.environ.get("CANDELABRA_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CANDELABRA_API_KEY)")
    net.add_argument("--max-waiting", type=int, default=1024,
                     help="refuse new requests with 503 while this many wait to run (default 1024)")
    net.add_argument("--log", action="store_true", help="log every request (uvicorn access log) and engine detail")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--backend", default="auto", help="cpu, cuda, metal, gcu, a plugin's name, or auto")
    engine.add_argument("--device-ids", help="devices to use; one device so far (e.g. \"0\")")
    engine.add_argument("--kvcache-mem-gpu", type=float, default=1024, metavar="MB",
                        help="KV cache memory on the device in MB (default 1024)")
    engine.add_argument("--kvcache-mem-cpu", type=float, default=128, metavar="MB",
                        help="host memory for swapped-out KV blocks in MB (default 128; 0: preempt by recompute)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch at most (default 64)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    engine.add_argument("--prefill-chunk-size", type=int, default=512,
                        help="prefill long prompts in chunks of this many tokens (0: whole; default 512)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most")
    engine.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    engine.add_argument("--seed", type=int, help="seed for requests that name none (default: random)")

    sampling = parser.add_argument_group("sampling defaults (a request's own values win)")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--penalty", type=float, help="repetition penalty (1.0: none)")
    sampling.add_argument("--repeat-last-n", type=int, help="the repetition penalty looks at the last N tokens")
    sampling.add_argument("--max-gen-tokens", type=int, help="max tokens per response (default: a fifth of the "
                                                              "context)")
    sampling.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                          help="auto: the checkpoint's generation_config.json sets defaults under these flags; "
                               "none: ignore it (default auto)")
    sampling.add_argument("--thinking", action="store_true",
                          help="let reasoning models think (enable_thinking in the chat template)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.log else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "multipart"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        _check_unsupported(args)
        listener = _listen(args.host, args.port)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        served = _load(args)
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback
        listener.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _serve(served, args, listener)


def _check_unsupported(args: argparse.Namespace) -> None:
    if args.quant and args.quant.lower() != "gguf":
        raise ValueError(f"--quant {args.quant} is not supported yet; pass a .gguf checkpoint (Q4_0 ... Q8_0, "
                         "K-quants, F16), which is dequantized at load")
    if args.device_ids and len([d for d in args.device_ids.split(",") if d.strip()]) > 1:
        raise ValueError(f"--device-ids {args.device_ids}: serving on several devices (tensor parallelism) is not "
                         "supported yet; pass one device")
    for name in ("max_num_seqs", "block_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _load(args: argparse.Namespace):
    from candelabra.core.async_engine import AsyncEngine
    from candelabra.core.generation_config import recommended_sampling
    from candelabra.core.llm import LLM
    from candelabra.core.server.metrics import ServerMetrics
    from candelabra.core.server.serving import Served, ServerDefaults

    engine_options = {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
                      "prefill_chunk_size": args.prefill_chunk_size,
                      "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
                      "max_gen_tokens": args.max_gen_tokens, "seed": args.seed}
    llm = LLM(args.weight_path, backend=args.backend, dtype=DTYPE_ALIASES[args.dtype] if args.dtype else None,
              kvcache_mem_gpu=args.kvcache_mem_gpu, kvcache_mem_cpu=args.kvcache_mem_cpu, model_id=args.model_id,
              weight_file=args.weight_file, revision=args.revision, model_type=args.model_type, **engine_options)
    name = args.served_model_name or _model_name(args, llm.checkpoint)
    engine = AsyncEngine(llm.engine)
    recommended = recommended_sampling(llm.checkpoint) if args.generation_config == "auto" else {}
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "repetition_penalty": args.penalty}
    chosen = {**recommended, **{key: value for key, value in flags.items() if value is not None}}
    defaults = ServerDefaults(**chosen, repeat_last_n=args.repeat_last_n, thinking=True if args.thinking else None)
    return Served(name, engine, ServerMetrics(engine, name), defaults, args.max_waiting, llm=llm)


def _model_name(args: argparse.Namespace, checkpoint) -> str:
    from candelabra.core.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME

    if args.model_id:
        return args.model_id
    path = checkpoint.path
    if path.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def _serve(served, args: argparse.Namespace, listener: socket.socket) -> int:
    import uvicorn

    from candelabra.core.server.app import build_app

    host, port = listener.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    _print_start_up(served, url, args)
    config = uvicorn.Config(build_app(served, args.api_key), log_level="info" if args.log else "warning",
                            access_log=args.log, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[listener])
    finally:
        served.engine.shutdown()
    return 0


def _print_start_up(served, url: str, args: argparse.Namespace) -> None:
    llm, engine = served.llm, served.engine.engine
    config, kv = engine.config, engine.runner.kv_spec
    model = llm.model.config
    probe = type(llm.backend).probe()
    lines = [
        f"backend   {llm.backend.name} on {probe.device}",
        f"model     {served.name} ({model.architecture}, {model.num_layers} layers) from {llm.checkpoint.path}",
        f"dtype     {llm.model.dtype}",
        f"KV cache  {config.num_blocks * config.block_size} tokens ({config.num_blocks} blocks of "
        f"{config.block_size}, {kv.bytes_per_block * kv.num_blocks / 2**20:.0f} MiB); "
        f"swap space {config.num_host_blocks} blocks",
        f"context   {engine.max_model_len} tokens; up to {config.max_num_seqs} sequences per batch",
        f"sampling  {_describe_defaults(served.defaults)}",
        f"API key   {'required' if args.api_key else 'not required'}",
        f"serving   {url}  (OpenAI API at {url}/v1)",
    ]
    print("\n".join(lines), flush=True)


def _describe_defaults(defaults) -> str:
    """The sampling defaults requests get, e.g. "temperature 0.7, top_p 0.8 (requests may override)"."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_last_n")
    set_ = [f"{name} {getattr(defaults, name)}" for name in names if getattr(defaults, name) is not None]
    if defaults.thinking:
        set_.append("thinking on")
    return (", ".join(set_) + " (requests may override)") if set_ else "OpenAI's defaults (temperature 1, top_p 1)"
