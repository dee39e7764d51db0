"""`candelabra serve`: load the model, start the engine, and serve the OpenAI API on uvicorn.

Flags keep candle-vllm's names, and candle-vllm-gcu's short ones (--w, --f, --m, --p, --d, --mem); its
model-type word (llama3, qwen2, ...) may follow them and is checked against the checkpoint's own
architecture.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import socket
import sys
import threading

import uvicorn

from candelabra.core.contract.dtypes import FLOAT_DTYPES, QUANTIZED_KV_DTYPES
from candelabra.core.server.limits import add_limit_arguments, limits_from_arguments
from candelabra.core.worker.topology import DEFAULT_MASTER_PORT

log = logging.getLogger("candelabra")

DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32",
                 **{name: name for name in FLOAT_DTYPES}}
# A KV cache may also be quantized: int8 rows, or fp8 (e4m3) ones, each with a scale.
KV_DTYPE_ALIASES = {**DTYPE_ALIASES, **{name: name for name in QUANTIZED_KV_DTYPES}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_type", nargs="?", metavar="MODEL_TYPE",
                        help="candle-vllm's model-type word (llama3, qwen2, gemma3, ...), checked against the "
                             "checkpoint; optional, the checkpoint's config names its architecture")
    where = parser.add_argument_group("model (none given: the default model, Qwen2.5-Coder-0.5B-Instruct)")
    where.add_argument("--weight-path", "--w", help="checkpoint folder (safetensors, or one .gguf) or a .gguf file")
    where.add_argument("--weight-file", "--f", help="a file in --weight-path (or on its own), e.g. a .gguf")
    where.add_argument("--model-id", "--m", help="ORG/NAME of a model in the local Hugging Face cache")
    where.add_argument("--revision", help="revision of --model-id")
    where.add_argument("--served-model-name", help="the name clients use (default: from the checkpoint)")
    where.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), help="compute dtype (default: the backend's first)")
    where.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPE_ALIASES),
                       help="dtype of the KV cache, where the backend offers one beside the compute dtype (see "
                            "`candelabra backends`; default: the compute dtype): a float dtype, or int8 (cpu, "
                            "torch, cuda) or fp8 (cuda), quantized per row with a scale, for about twice the tokens "
                            "of a 16-bit cache in the same memory")
    where.add_argument("--quant", metavar="{gptq,awq,marlin,gguf,FORMAT}",
                       help="the checkpoint's quantization, checked against it: gptq or awq (4-bit safetensors), "
                            "marlin (either, through the fastest int4 kernel the backend has), gguf (default: the "
                            "checkpoint's own); or candle-vllm's name of a format for in-situ quantization (q4_0, "
                            "q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k), the same as --isq")
    where.add_argument("--isq", metavar="FORMAT",
                       help="in-situ quantization: quantize a dense checkpoint's linear weights (and LM head) at "
                            "load into this GGML format: q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k or q6k "
                            "(or GGML's names, Q4_K ...); weights whose in_features are not whole blocks of it "
                            "take q8_0, or stay dense where not a multiple of 32 (default: none)")
    where.add_argument("--load-format", metavar="{auto,dummy}", default="auto",
                       help="auto: the checkpoint's weights; dummy: random weights in the shapes of the config.json "
                            "that --weight-path or --model-id names, for benchmarks without a checkpoint (the "
                            "folder's tokenizer if it has one, else a byte-level stand-in) (default: auto)")
    where.add_argument("--dummy-quantization", metavar="FORMAT",
                       help="with --load-format dummy: linear weights as random blocks of this GGUF format (Q4_K, "
                            "Q8_0, ...) or grouped int4 as GPTQ and AWQ checkpoints load (INT4_G128, ...), kept "
                            "quantized by a backend that keeps it (default: dense)")

    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to expose; default 127.0.0.1)")
    net.add_argument("--port", "--p", type=int, default=2000, help="port (0 picks a free one; default 2000)")
    net.add_argument("--api-key", default=os.environ.get("CANDELABRA_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CANDELABRA_API_KEY)")
    net.add_argument("--max-waiting", type=int, default=1024,
                     help="refuse new requests with 503 while this many wait to run (default 1024)")
    net.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                     help="on stopping, requests in flight get this long to finish before they are aborted "
                          "(default 5)")
    net.add_argument("--log", action="store_true", help="log every request (uvicorn access log) and engine detail")
    net.add_argument("--no-ui", action="store_true", help="do not serve the web chat page at / (served by default)")
    net.add_argument("--ui-server", action="store_true",
                     help="candle-vllm's flag for its chat page, accepted and ignored: the page is on by default "
                          "(see --no-ui)")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--backend", default="auto",
                        help="an installed backend (see `candelabra backends`: cpu, metal, a plugin's name), a backend "
                             "class not installed yet as package.module:Class, or auto, the best available here "
                             "(default: auto)")
    engine.add_argument("--device-ids", "--d",
                        help="the devices to run on, by index: one (default 0), or several, comma-separated, for "
                             "tensor parallelism, one process each (on a CPU with torch, ranks sharing the cores)")
    engine.add_argument("--numa-bind-nodes", metavar="NODES",
                        help="the NUMA node each of --device-ids keeps its threads and memory to, comma-separated "
                             "(e.g. 0,0,1,1, as candle-vllm's MAP_NUMA_NODE), or none; by default, where the machine "
                             "has several nodes, tensor-parallel ranks are spread over them")
    engine.add_argument("--num-nodes", type=int, default=1,
                        help="machines the ranks run on, each with the same --device-ids (default 1)")
    engine.add_argument("--node-rank", type=int, default=0,
                        help="this machine's place among --num-nodes; node 0 serves, the others only run ranks "
                             "(default 0)")
    engine.add_argument("--master-addr", default="127.0.0.1",
                        help="the address of node 0, where the ranks meet (default 127.0.0.1)")
    engine.add_argument("--master-port", type=int,
                        help=f"the port on node 0 where the ranks meet (default: a free one on one node, "
                             f"{DEFAULT_MASTER_PORT} across nodes)")
    engine.add_argument("--kvcache-mem-gpu", "--mem", type=float, metavar="MB",
                        help="KV cache memory on the device in MB; wins over --kv-fraction (default: sized by "
                             "--kv-fraction)")
    engine.add_argument("--kv-fraction", type=float, metavar="F",
                        help="without --kvcache-mem-gpu, the KV cache takes this share of the backend's free "
                             "memory, never more than --max-num-seqs sequences of the whole context can fill "
                             "(default: the backend's share; on the CPU backends 0.25 of the available RAM, which "
                             "is shared with everything else)")
    engine.add_argument("--kvcache-mem-cpu", type=float, default=128, metavar="MB",
                        help="host memory for swapped-out KV blocks in MB (default 128; 0: preempt by recompute)")
    engine.add_argument("--disable-cuda-graph", action="store_true",
                        help="run every step op by op: no CUDA graphs on cuda, nothing captured or compiled elsewhere")
    engine.add_argument("--num-experts-offload-per-rank", type=int, default=0, metavar="N",
                        help="a mixture-of-experts model: keep N of each MoE layer's experts (on each rank) in host "
                             "memory, copied to the device when routed to; the device keeps --expert-cache-slots of "
                             "them, the most recently used (default 0: none; changes nothing where the backend's "
                             "tensors are in host memory already: on a CPU, or in unified memory)")
    engine.add_argument("--expert-cache-slots", type=int, metavar="S",
                        help="with --num-experts-offload-per-rank N: device slots per MoE layer for experts from "
                             "host memory, 1 to N (default: N / 4, rounded up)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch at most (default 64)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    engine.add_argument("--prefill-chunk-size", type=int, default=512,
                        help="prefill long prompts in chunks of this many tokens (0: whole; default 512)")
    engine.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens in one step at most (default: the backend's; 512 on a CPU with torch, else 2048)")
    engine.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    engine.add_argument("--seed", type=int, help="seed for requests that name none (default: random)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        help="schedule and launch each step before the one running has returned its tokens, so "
                             "that the host's work for a step overlaps the device's for the one before (a request "
                             "that ends computes one token for nothing). Default: "
                             "on where the backend's device computes apart from the host (cuda), off on a CPU")

    sampling = parser.add_argument_group("sampling defaults (a request's own values win)")
    sampling.add_argument("--temperature", type=float,
                          help="randomness of sampling: 0 always takes the likeliest token (default: the "
                               "checkpoint's recommendation, else 1)")
    sampling.add_argument("--top-k", type=int, help="sample among the K likeliest tokens only (0 or -1: all)")
    sampling.add_argument("--top-p", type=float,
                          help="sample among the likeliest tokens whose probabilities add up to P, in (0, 1] "
                               "(1: all)")
    sampling.add_argument("--penalty", type=float, help="repetition penalty (1.0: none)")
    sampling.add_argument("--repeat-last-n", type=int, help="the repetition penalty looks at the last N tokens")
    sampling.add_argument("--max-gen-tokens", type=int, help="max tokens per response (default: a fifth of the "
                                                              "context)")
    sampling.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                          help="auto: the checkpoint's generation_config.json sets defaults under these flags; "
                               "none: ignore it (default auto)")
    sampling.add_argument("--thinking", action="store_true",
                          help="let reasoning models think (enable_thinking in the chat template)")
    net.add_argument("--embedding-pooling", choices=("mean", "last"), default="mean",
                     help="how /v1/embeddings pools the hidden states where a request does not say: the mean "
                          "over the tokens, or the last token's (default mean)")
    add_limit_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.log else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "multipart"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The cheap checks come first, so a wrong flag is never hidden behind a busy port or a long load.
    try:
        check_arguments(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.node_rank > 0:
        return _run_ranks(args)
    try:
        backend, checkpoint = _backend_and_checkpoint(args)
        listener = _listen(args.host, args.port)
    except OSError as exc:
        print(f"error: {_listen_failure(args.host, args.port, exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        served = _load(args, backend, checkpoint)
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback
        listener.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _serve(served, args, listener)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the flag, values that cannot serve a request."""
    from candelabra.core.loading.open import check_load_format
    from candelabra.core.loading.quant_flag import parse_quant
    from candelabra.core.requests.sampling_params import SamplingParams
    from candelabra.core.worker.kv_cache_size import check_kv_fraction

    parse_quant(args.quant, args.isq)
    check_load_format(args.load_format, args.dummy_quantization)
    topology_of(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0 to 65535 (0 picks a free port), not {args.port}")
    minimums = {"max_num_seqs": 1, "block_size": 1, "max_waiting": 1, "max_num_batched_tokens": 1,
                "prefill_chunk_size": 0, "max_model_len": 2, "max_gen_tokens": 1}
    for name, least in minimums.items():
        value = getattr(args, name)
        if value is not None and value < least:
            why = " (a prompt token and a generated one)" if name == "max_model_len" else ""
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}{why}, not {value}")
    limits_from_arguments(args)
    if not 0 <= args.shutdown_grace < math.inf:
        raise ValueError(f"--shutdown-grace must be 0 seconds or more, not {args.shutdown_grace:g}")
    if args.kvcache_mem_gpu is not None and not args.kvcache_mem_gpu > 0:
        raise ValueError(f"--kvcache-mem-gpu must be more than 0 MB, not {args.kvcache_mem_gpu:g}")
    if args.kv_fraction is not None:
        check_kv_fraction(args.kv_fraction, "--kv-fraction")
    if args.num_experts_offload_per_rank or args.expert_cache_slots is not None:
        from candelabra.core.models.offloaded_experts import ExpertOffload

        if args.num_experts_offload_per_rank == 0:
            raise ValueError("--expert-cache-slots sizes the device's cache of experts kept in host memory: give "
                             "--num-experts-offload-per-rank too")
        ExpertOffload(args.num_experts_offload_per_rank, args.expert_cache_slots)
    if not args.kvcache_mem_cpu >= 0:
        raise ValueError(f"--kvcache-mem-cpu must be 0 MB (no swap space) or more, not {args.kvcache_mem_cpu:g}")
    flags = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "penalty": "repetition_penalty",
             "repeat_last_n": "repeat_last_n"}
    for flag, field in flags.items():
        value = getattr(args, flag)
        if value is not None:
            try:
                SamplingParams(**{field: value})
            except ValueError as exc:
                raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None


def _run_ranks(args: argparse.Namespace) -> int:
    """A node other than 0: run its ranks (the first here, the others as processes of their own)
    until node 0 tells them to stop or goes away. It serves nothing itself."""
    from candelabra.core.loading.quant_flag import parse_quant
    from candelabra.core.worker.rank_process import WorkerSpec, run_worker
    from candelabra.core.worker.worker_processes import WorkerProcesses

    topology = topology_of(args)
    try:
        backend, _ = _backend_and_checkpoint(args)
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    source = dict(backend=backend.name, model=args.weight_path, model_id=args.model_id, weight_file=args.weight_file,
                  revision=args.revision, load_format=args.load_format, dummy_quantization=args.dummy_quantization,
                  dtype=DTYPE_ALIASES[args.dtype] if args.dtype else None, model_type=args.model_type,
                  topology=topology, num_experts_offload_per_rank=args.num_experts_offload_per_rank,
                  expert_cache_slots=args.expert_cache_slots, isq=parse_quant(args.quant, args.isq)[1])
    others = WorkerProcesses([WorkerSpec(**source, local=local) for local in range(1, len(topology.device_ids))])
    first = topology.device(0).rank
    print(f"node {topology.node_rank}: ranks {first} to {first + len(topology.device_ids) - 1} of "
          f"{topology.world_size}, meeting at {topology.master_addr}:{topology.master_port}", flush=True)
    try:
        run_worker(WorkerSpec(**source, local=0), while_waiting=others.check_running)
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback
        print(f"error: rank {first}: {exc}", file=sys.stderr)
        return 1
    finally:
        others.stop()
    print(f"node {topology.node_rank}: stopped", flush=True)
    return 0


def topology_of(args: argparse.Namespace):
    """Where the ranks run, from --device-ids, --num-nodes, --node-rank, --master-addr, --master-port and
    --numa-bind-nodes; ValueError naming the flag for values that cannot be."""
    from candelabra.core.contract.device import Device
    from candelabra.core.worker.numa_nodes import allowed_cpus, bindings, machine_nodes, parse_bind_nodes
    from candelabra.core.worker.topology import Topology

    ids = Device.parse_ids(args.device_ids) or (0,)
    port = args.master_port
    if port is None:
        port = _free_port() if args.num_nodes == 1 and len(ids) > 1 else DEFAULT_MASTER_PORT
        args.master_port = port  # chosen once: every later call must give the same topology
    topology = Topology(ids, args.num_nodes, args.node_rank, args.master_addr, port,
                        parse_bind_nodes(args.numa_bind_nodes))
    bindings(len(ids), topology.numa_bind_nodes, machine_nodes(), allowed_cpus())  # ValueError for a node not here
    return topology


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def _backend_and_checkpoint(args: argparse.Namespace):
    """The backend class and the opened checkpoint, whose config must name a known architecture
    (and match MODEL_TYPE): all that can be checked before the weights load."""
    from candelabra.core.contract.device import Device
    from candelabra.core.llm import choose_backend, open_model
    from candelabra.core.loading.quant_flag import parse_quant
    from candelabra.core.models.config import ModelConfig

    backend = choose_backend(args.backend)
    for index in Device.parse_ids(args.device_ids) or (0,):
        backend.check_device(Device(index))
    if args.kv_cache_dtype:
        compute = DTYPE_ALIASES[args.dtype] if args.dtype else backend.dtypes[0]
        backend.check_kv_cache_dtype(KV_DTYPE_ALIASES[args.kv_cache_dtype], compute)
    checkpoint = open_model(args.weight_path, args.model_id, args.weight_file, args.revision, args.load_format,
                            args.dummy_quantization, *parse_quant(args.quant, args.isq))
    config = ModelConfig.from_hf(checkpoint.config)
    if args.model_type:
        config.check_model_type(args.model_type)
    if args.num_experts_offload_per_rank:
        from candelabra.core.models.offloaded_experts import ExpertOffload

        ExpertOffload(args.num_experts_offload_per_rank, args.expert_cache_slots).check_model(config)
    return backend, checkpoint


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _listen_failure(host: str, port: int, exc: OSError) -> str:
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}: the address is already in use, perhaps by a server that is already running there; stop "
                "it, or pass --port N for another port (--port 0 picks a free one)")
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges); pass --port 1024 or above"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine; pass --host 127.0.0.1 or 0.0.0.0"
    return f"{where}: {exc.strerror or exc}"


def _load(args: argparse.Namespace, backend: type, checkpoint):
    from candelabra.core.engine.async_engine import AsyncEngine
    from candelabra.core.llm import LLM
    from candelabra.core.server.generation_config import recommended_sampling
    from candelabra.core.server.metrics import ServerMetrics
    from candelabra.core.server.serving import ServedModel, ServerDefaults

    engine_options = {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
                      "prefill_chunk_size": args.prefill_chunk_size,
                      "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
                      "max_gen_tokens": args.max_gen_tokens, "seed": args.seed,
                      "async_scheduling": args.async_scheduling}
    loaded: list[LLM] = []

    def load_model():
        loaded.append(LLM(checkpoint, backend=backend, topology=topology_of(args),
                          dtype=DTYPE_ALIASES[args.dtype] if args.dtype else None,
                          kv_cache_dtype=KV_DTYPE_ALIASES[args.kv_cache_dtype] if args.kv_cache_dtype else None,
                          kvcache_mem_gpu=args.kvcache_mem_gpu, kv_fraction=args.kv_fraction,
                          kvcache_mem_cpu=args.kvcache_mem_cpu, model_type=args.model_type,
                          eager_steps=args.disable_cuda_graph,
                          num_experts_offload_per_rank=args.num_experts_offload_per_rank,
                          expert_cache_slots=args.expert_cache_slots, **engine_options))
        return loaded[0].engine

    engine = AsyncEngine(load_model)  # loaded on the thread that will step it
    llm = loaded[0]
    threading.Thread(target=llm.engine.grammars.warm_up, name="grammar-warm-up", daemon=True).start()
    if llm.workers is not None:
        llm.workers.watch(engine.fail)
    name = args.served_model_name or _model_name(args, llm.checkpoint)
    recommended = recommended_sampling(llm.checkpoint) if args.generation_config == "auto" else {}
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "repetition_penalty": args.penalty}
    chosen = {**recommended, **{key: value for key, value in flags.items() if value is not None}}
    defaults = ServerDefaults(**chosen, repeat_last_n=args.repeat_last_n, thinking=True if args.thinking else None)
    return ServedModel(name, engine, ServerMetrics(engine, name), defaults, args.max_waiting,
                       limits_from_arguments(args), llm=llm)


def _model_name(args: argparse.Namespace, checkpoint) -> str:
    from candelabra.core.weights.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME

    if args.model_id:
        return args.model_id
    path = checkpoint.path
    if path.name == DEFAULT_MODEL_FILE:
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def _serve(served, args: argparse.Namespace, listener: socket.socket) -> int:
    from candelabra.core.server.app import build_app

    host, port = listener.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    _print_start_up(served, url, args)
    app = build_app(served, args.api_key, chat_page=not args.no_ui, embedding_pooling=args.embedding_pooling)
    config = uvicorn.Config(app, log_level="info" if args.log else "warning",
                            access_log=args.log, timeout_graceful_shutdown=args.shutdown_grace + 5)
    server = _StoppingServer(config, served, args.shutdown_grace)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has stopped cleanly
        pass
    finally:
        served.engine.shutdown()
        if served.llm is not None:
            served.llm.close()
    if served.engine.failure is not None:
        print(f"error: the engine failed, so the server stopped: {served.engine.failure}", file=sys.stderr)
        return 1
    return 0


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, which on stopping gives the requests in flight `grace` seconds to finish,
    ends the rest with a 503 (or an error event in their stream) instead of cutting them off,
    shuts the engine down and says how many requests it aborted. The line is printed here because
    uvicorn raises the stopping signal again once this returns."""

    def __init__(self, config: uvicorn.Config, served, grace: float) -> None:
        super().__init__(config)
        self.served, self.grace = served, grace

    async def on_tick(self, counter: int) -> bool:
        """Stop serving once the engine has failed: /health has said why meanwhile."""
        return await super().on_tick(counter) or self.served.engine.failure is not None

    async def shutdown(self, sockets=None) -> None:
        aborted_before = self.served.metrics.finished_by_reason["abort"]
        ender = asyncio.get_running_loop().call_later(self.grace, self.served.engine.stop_all)
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()
            self.served.engine.shutdown()
            aborted = self.served.metrics.finished_by_reason["abort"] - aborted_before
            plural = "" if aborted == 1 else "s"
            print(f"stopped; {aborted} request{plural} in flight aborted" if aborted else
                  "stopped; no request was in flight", flush=True)


def _print_start_up(served, url: str, args: argparse.Namespace) -> None:
    llm, engine = served.llm, served.engine.llm_engine
    config, kv = engine.config, engine.runner.kv_spec
    model = llm.model.config
    probe = type(llm.backend).probe()
    lines = [
        f"backend   {llm.backend.name} on {probe.detail}",
        f"model     {served.name} ({model.architecture}, {model.num_layers} layers) from {_weights_source(llm)}",
        f"dtype     {llm.model.dtype}{_rounding(llm.backend)}",
        f"KV cache  {config.num_blocks * config.block_size} tokens ({config.num_blocks} blocks of "
        f"{config.block_size}, {kv.bytes_per_block * kv.num_blocks / 2**20:.0f} MiB in {kv.dtype}); "
        f"swap space {config.num_host_blocks} blocks",
        f"          sized by {llm.kv_cache_chosen_by}",
        *_experts_line(llm.model),
        f"context   {engine.max_model_len} tokens; up to {config.max_num_seqs} sequences per batch",
        f"sampling  {_describe_defaults(served.defaults)}",
        f"API key   {'required' if args.api_key else 'not required'}",
        f"serving   {url}  (OpenAI API at {url}/v1)",
    ]
    if not getattr(args, "no_ui", False):
        lines.append(f"chat page {url}/")
    print("\n".join(lines), flush=True)


def _rounding(backend) -> str:
    rounding = backend.activation_rounding()
    return "" if rounding is None else f"; x rounded to {rounding} before quantized products, where faster"


def _experts_line(model) -> list[str]:
    """How many experts live in host memory, where some do."""
    from candelabra.core.models.offloaded_experts import describe_offload

    described = describe_offload(model.layers)
    return [] if described is None else [f"experts   {described}"]


def _weights_source(llm) -> str:
    from candelabra.core.loading.dummy import DummyCheckpoint
    from candelabra.core.loading.in_situ import InSituQuantized

    checkpoint, quantized = llm.checkpoint, ""
    if isinstance(checkpoint, InSituQuantized):
        checkpoint, quantized = checkpoint.dense, f", linear weights quantized at load to {checkpoint.format} (--isq)"
    if not isinstance(checkpoint, DummyCheckpoint):
        return f"{checkpoint.path}{quantized}"
    kind = f"{checkpoint.quantization} " if checkpoint.quantization else ""
    return (f"random {kind}weights (--load-format dummy, seed {checkpoint.seed}) shaped by {checkpoint.path}"
            f"{quantized}")


def _describe_defaults(defaults) -> str:
    """The sampling defaults requests get, e.g. "temperature 0.7, top_p 0.8 (requests may override)"."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_last_n")
    set_ = [f"{name} {getattr(defaults, name)}" for name in names if getattr(defaults, name) is not None]
    if defaults.thinking:
        set_.append("thinking on")
    return (", ".join(set_) + " (requests may override)") if set_ else "OpenAI's defaults (temperature 1, top_p 1)"
