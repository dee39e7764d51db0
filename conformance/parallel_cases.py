"""Tensor parallelism against one process: the communicator's collectives, and every model case at
TP=W against the same model at TP=1.

`run_communicator_checks` has W processes on the backend join one group (`Backend.communicator` on
127.0.0.1) and checks each collective against what every rank's known inputs make: all_reduce in
every compute dtype the backend offers, all_gather along the first and the last dimension,
broadcast_object from the last rank, barrier.

`run_parallel_cases` takes every case of the models level (`model_cases`: each architecture's tiny
safetensors checkpoint, and the GGUF ones in each tensor type); each of W processes loads its shard
of the model, and rank 0 the whole model too. Rank 0's tensor-parallel logits for every prompt
position must match the whole model's within the models level's NMSE threshold for the dtype (its
mixture-of-experts one for a MoE case, whose ranks each run a share of the experts), and
16 greedy tokens decoded through the paged cache must be the same (a step where the whole model's
two best logits tie, as the models level counts ties, ends the comparison without failing it). Where the
backend says it may round x to int8 before quantized products, a quantized checkpoint's shard may take
another kernel than the whole model's: its logits are held to the models level's limit for that rounding,
and its greedy tokens reported, not required.

Independent of the serving runtime: the processes are started here (rank r on device r modulo the
backend's device count, and on its share of this process's CPU cores), and each runs its model
directly, step by step, on the host's step metadata. A rank that fails outside a check's or a
case's result (a broken group, a crash) makes the run raise RuntimeError with its traceback.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from candelabra.conformance.compare import (
    MODEL_NMSE_THRESHOLDS,
    MOE_MODEL_NMSE_THRESHOLDS,
    NMSE_THRESHOLDS,
    ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD,
    nmse,
    round_to,
)
from candelabra.conformance.harness import case_seed
from candelabra.conformance.model_cases import (
    BLOCK_SIZE,
    GGUF_MODEL_CASES,
    GREEDY_TIE_MARGINS,
    GREEDY_TOKENS,
    MODEL_CASES,
    PROMPT_TOKENS,
    GGUFModelCase,
    Int4ModelCase,
    ModelCase,
    _gguf_reference,
    make_reference,
    quantized_checkpoint,
)
from candelabra.conformance.quantized_checkpoints import write_int4_checkpoint
from candelabra.core.contract.step_metadata import StepMetadata

MASTER_ADDR = "127.0.0.1"


@dataclass
class CollectiveResult:
    """One collective checked at `world_size` ranks: "passed" or "failed", and what was seen."""

    check: str
    world_size: int
    status: str
    detail: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ParallelResult:
    """One model case at `world_size` ranks: "passed" or "failed", the NMSE of rank 0's prompt logits
    against the unsharded model's, and how many greedy tokens agreed ("16/16", or where they parted
    and whether at a tie)."""

    case: str
    world_size: int
    status: str
    nmse: float | None
    greedy: str
    seed: int
    message: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_communicator_checks(backend: str, world_size: int, seed: int = 0,
                            timeout_s: float = 60.0) -> list[CollectiveResult]:
    """Each collective of `backend`'s communicator (a registered backend name, or
    "package.module:ClassName") over `world_size` processes, checked on rank 0. all_reduce
    passes within the dtype's op NMSE threshold of the exact sum, and says whether every element
    is the exact sum rounded once (as it must be at two ranks); the others must be exact."""
    return _run_ranks(backend, world_size, functools.partial(_check_collectives, seed=seed), timeout_s,
                      deadline_s=10 * timeout_s)


def run_parallel_cases(backend: str, world_size: int,
                       cases: list[ModelCase | GGUFModelCase | Int4ModelCase] | None = None,
                       seed: int = 0, dtype: str = "float32", lm_head_layout: str | None = None,
                       timeout_s: float = 120.0) -> list[ParallelResult]:
    """Every case of `cases` (default: those of the models level that shard) on `backend` (a registered
    backend name, or "package.module:ClassName") at tensor parallelism over `world_size` processes
    against TP=1, computing in `dtype`. `lm_head_layout` picks the LM head's layout (default: the
    model's own). A collective that waits longer than `timeout_s` fails the run."""
    if cases is None:
        cases = [case for case in MODEL_CASES + GGUF_MODEL_CASES if getattr(case, "tensor_parallel", True)]
    cases = list(cases)
    with tempfile.TemporaryDirectory(prefix="candelabra-parallel-") as folder:
        work = functools.partial(_run_cases, cases=cases, seed=seed, dtype=dtype, lm_head_layout=lm_head_layout,
                                 folder=folder)
        return _run_ranks(backend, world_size, work, timeout_s, deadline_s=timeout_s * (len(cases) + 2))


def _run_ranks(backend: str, world_size: int, work: Callable, timeout_s: float, deadline_s: float):
    """What `work(backend, communicator)` returns on rank 0 of `world_size` spawned processes."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    job = _Job(backend, world_size, _free_port(), timeout_s, work)
    ranks = [context.Process(target=_rank_main, args=(job, rank, messages), daemon=True)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    try:
        return _await_result(ranks, messages, deadline_s)
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


@dataclass(frozen=True)
class _Job:
    backend: str
    world_size: int
    port: int
    timeout_s: float
    work: Callable  # (backend, communicator) -> rank 0's result


def _await_result(ranks, messages, deadline_s: float):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            kind, rank, payload = messages.get(timeout=1.0)
        except queue.Empty:
            dead = [rank for rank, process in enumerate(ranks) if process.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"tensor-parallel rank {dead[0]} died (exit code {ranks[dead[0]].exitcode}) "
                                   "without reporting") from None
            continue
        if kind == "error":
            for process in ranks:
                process.kill()
            raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{payload}")
        return payload
    raise RuntimeError(f"tensor-parallel ranks did not finish within {deadline_s:.0f} s")


def _rank_main(job: _Job, rank: int, messages) -> None:
    """One rank: join the group, do the work, and (rank 0) report its result."""
    communicator = None
    try:
        _take_share_of_cores(rank, job.world_size)
        from candelabra.core.contract.device import Device
        from candelabra.plugins import backend_class

        backend_type = backend_class(job.backend)
        backend = backend_type(Device(rank % backend_type.device_count(), rank, job.world_size))
        communicator = backend.communicator(MASTER_ADDR, job.port, job.timeout_s)
        result = job.work(backend, communicator)
        if rank == 0:
            messages.put(("result", rank, result))
    except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
        messages.put(("error", rank, traceback.format_exc()))
    finally:
        if communicator is not None:
            communicator.close()


def _take_share_of_cores(rank: int, world_size: int) -> None:
    """Run on every world_size-th of the cores this process may use, starting at the rank's, so
    that ranks on one CPU do not each start a thread per core."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[rank % len(cores) :: world_size] or cores)


# the collectives


def _check_collectives(backend, communicator, seed: int) -> list[CollectiveResult]:
    world_size = communicator.world_size
    results = [_check_all_reduce(backend, communicator, dtype, seed) for dtype in backend.dtypes]
    results += [_check_all_gather(backend, communicator, dim, seed) for dim in (0, -1)]
    sent = {"from": world_size - 1, "array": np.arange(5.0), "text": "ünïcode"}
    received = communicator.broadcast_object(sent if communicator.rank == world_size - 1 else None, src=world_size - 1)
    same = received.keys() == sent.keys() and np.array_equal(received["array"], sent["array"]) and (
        received["text"], received["from"]) == (sent["text"], sent["from"])
    results.append(CollectiveResult(f"broadcast_object from rank {world_size - 1}", world_size,
                                    "passed" if same else "failed", "" if same else f"got {received!r}"))
    communicator.barrier()
    results.append(CollectiveResult("barrier", world_size, "passed"))
    return results


def _rank_input(rank: int, seed: int, shape: tuple[int, ...] = (3, 37)) -> np.ndarray:
    """Rank `rank`'s input to a collective: fresh random values, never zeros, that any rank can draw."""
    return np.random.default_rng([seed, rank]).standard_normal(shape).astype(np.float32)


def _check_all_reduce(backend, communicator, dtype: str, seed: int) -> CollectiveResult:
    world_size = communicator.world_size
    inputs = [round_to(_rank_input(rank, seed), dtype) for rank in range(world_size)]
    exact = np.sum(inputs, axis=0, dtype=np.float64)
    summed = backend.to_host(communicator.all_reduce(backend.to_device(inputs[communicator.rank], dtype)))
    error = nmse(summed, exact)
    rounded_once = np.array_equal(summed, round_to(exact.astype(np.float32), dtype))
    passed = error <= NMSE_THRESHOLDS[dtype] or rounded_once
    detail = f"NMSE {error:.3g} against the exact sum; {'each' if rounded_once else 'not each'} element the " \
             "exact sum rounded once"
    return CollectiveResult(f"all_reduce {dtype}", world_size, "passed" if passed else "failed", detail)


def _check_all_gather(backend, communicator, dim: int, seed: int) -> CollectiveResult:
    world_size = communicator.world_size
    inputs = [_rank_input(rank, seed + 1) for rank in range(world_size)]
    gathered = backend.to_host(communicator.all_gather(backend.to_device(inputs[communicator.rank], "float32"), dim))
    same = np.array_equal(gathered, np.concatenate(inputs, axis=dim))
    return CollectiveResult(f"all_gather dim={dim}", world_size, "passed" if same else "failed",
                            "" if same else f"got shape {list(gathered.shape)}, not every rank's input in rank order")


# the model cases


def _run_cases(backend, communicator, cases, seed, dtype, lm_head_layout, folder) -> list[ParallelResult | None]:
    """Every case, one after another: rank 0's results (the other ranks' are None)."""
    return [_run_case(backend, communicator, case, seed, dtype, lm_head_layout, folder) for case in cases]


def _run_case(backend, communicator, case, base_seed: int, dtype: str, lm_head_layout: str | None,
              folder: str) -> ParallelResult | None:
    """The case's result on rank 0 (None on the others, which run their shards alongside)."""
    rank, world_size, seed = communicator.rank, communicator.world_size, case_seed(base_seed, case.name)

    def failed(message: str) -> ParallelResult:
        return ParallelResult(case.name, world_size, "failed", None, "", seed, message)

    written = _written_checkpoint(case, seed, os.path.join(folder, case.name)) if rank == 0 else None
    path, problem = communicator.broadcast_object(written)
    if problem:
        return failed(f"writing the checkpoint failed: {problem}")
    sharded, whole, problem = _load(backend, communicator, path, dtype, lm_head_layout)
    problems = _from_every_rank(communicator, problem)
    if any(problems):
        return failed("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p))

    prompt = np.random.default_rng(seed).integers(3, sharded.config.vocab_size,
                                                  getattr(case, "prompt_tokens", PROMPT_TOKENS))
    blocks = np.random.default_rng(seed + 1).permutation(2 * -(-(len(prompt) + GREEDY_TOKENS) // BLOCK_SIZE))
    expected = greedy_decode(backend, whole, prompt, blocks.tolist()) if rank == 0 else None
    actual = greedy_decode(backend, sharded, prompt, blocks.tolist(), communicator)
    thresholds = MOE_MODEL_NMSE_THRESHOLDS if getattr(case, "routes_experts", False) else MODEL_NMSE_THRESHOLDS
    # a shard's products may take other kernels than the whole model's, one rounding x where the other does not
    rounded = backend.activation_rounding() if quantized_checkpoint(case) else None
    threshold = max(thresholds[dtype], ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD if rounded else 0.0)
    return (_compared(case.name, world_size, dtype, seed, expected, actual, threshold, greedy_required=rounded is None)
            if rank == 0 else None)


def _written_checkpoint(case, seed: int, folder: str) -> tuple[str | None, str | None]:
    """(where the case's checkpoint now lies, None), or (None, why not)."""
    try:
        os.makedirs(folder)
        if isinstance(case, GGUFModelCase):
            return _gguf_reference(case, seed, folder)[1], None
        if isinstance(case, Int4ModelCase):
            return str(write_int4_checkpoint(make_reference(case, seed), case.layout, folder, seed)), None
        make_reference(case, seed).save_pretrained(folder)
        return folder, None
    except Exception as exc:  # noqa: BLE001 - the case fails with the reason, on every rank
        return None, f"{type(exc).__name__}: {exc}"


def _load(backend, communicator, path: str, dtype: str, lm_head_layout: str | None):
    """(this rank's shard, the whole model on rank 0 else None, None), or (None, None, why not)."""
    from candelabra.core.loading.model import load_model
    from candelabra.core.weights.gguf import GGUFCheckpoint
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    try:
        with GGUFCheckpoint(path) if path.endswith(".gguf") else SafetensorsCheckpoint(path) as checkpoint:
            whole = load_model(checkpoint, backend, dtype) if communicator.rank == 0 else None
            sharded = load_model(checkpoint, backend, dtype, communicator=communicator, lm_head_layout=lm_head_layout)
        return sharded, whole, None
    except Exception as exc:  # noqa: BLE001 - loading makes no collective call, so every rank can go on
        return None, None, f"{type(exc).__name__}: {exc}"


def _from_every_rank(communicator, value) -> list:
    """Every rank's picklable `value`, in rank order, on every rank."""
    return [communicator.broadcast_object(value if communicator.rank == src else None, src=src)
            for src in range(communicator.world_size)]


@dataclass
class Decoded:
    """A greedy decode: the prompt's logits [P, vocab], the tokens chosen, and the logits of the
    last position each token was chosen from."""

    prompt_logits: np.ndarray
    tokens: list[int]
    choice_logits: list[np.ndarray]


def greedy_decode(backend, model, prompt: np.ndarray, blocks: list[int], communicator=None) -> Decoded:
    """The prompt's logits in one prefill step, then GREEDY_TOKENS greedy tokens decoded one step at
    a time through the paged cache in `blocks`. With a communicator (of a tensor-parallel `model`)
    every rank takes rank 0's choice, so that all ranks run the same steps."""
    from candelabra.core.worker.model_runner import ModelRunner

    runner = ModelRunner(model, num_blocks=len(blocks), block_size=BLOCK_SIZE)  # caching this rank's KV heads
    prefill = StepMetadata.build([len(prompt)], [len(prompt)], [blocks], BLOCK_SIZE,
                                 logits_rows=np.arange(len(prompt)))
    prompt_logits = backend.to_host(runner.logits(prompt, prefill))
    decoded = Decoded(prompt_logits, [], [prompt_logits[-1]])
    while True:
        token = int(np.argmax(decoded.choice_logits[-1]))
        decoded.tokens.append(token if communicator is None else communicator.broadcast_object(token))
        if len(decoded.tokens) == GREEDY_TOKENS:
            return decoded
        decode = StepMetadata.build([1], [len(prompt) + len(decoded.tokens)], [blocks], BLOCK_SIZE)
        decoded.choice_logits.append(backend.to_host(runner.logits(np.array([decoded.tokens[-1]]), decode))[0])


def _compared(name: str, world_size: int, dtype: str, seed: int, expected: Decoded, actual: Decoded,
              threshold: float, greedy_required: bool = True) -> ParallelResult:
    error = nmse(actual.prompt_logits, expected.prompt_logits)
    greedy = _greedy_agreement(expected, actual, dtype)
    problems = [] if error <= threshold else [f"logits NMSE {error:.3g} > {threshold:.0e} ({dtype})"]
    if greedy_required and not (greedy.startswith(f"{GREEDY_TOKENS}/") or greedy.endswith("tie")):
        problems.append(f"greedy tokens diverged after {greedy}")
    return ParallelResult(name, world_size, "failed" if problems else "passed", error, greedy, seed,
                          "; ".join(problems))


def _greedy_agreement(expected: Decoded, actual: Decoded, dtype: str) -> str:
    for step, (want, got) in enumerate(zip(expected.tokens, actual.tokens)):
        if want != got:
            second, best = np.sort(expected.choice_logits[step])[-2:]
            tie = best - second <= GREEDY_TIE_MARGINS[dtype] * max(1.0, abs(best))
            return f"{step}/{GREEDY_TOKENS}, then a tie" if tie else f"{step}/{GREEDY_TOKENS}"
    return f"{GREEDY_TOKENS}/{GREEDY_TOKENS}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((MASTER_ADDR, 0))
        return probe.getsockname()[1]
