"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step (every sequence one new token, each token sampled once, in order) is padded up to
the next capture size with `pad_step_inputs` and copied into that size's persistent input
buffers; the graph captured over those buffers then runs the whole forward and the LM head in one
launch. Sampling runs after it, op by op: which sampling kernels a batch needs depends on its
parameters, and none of them waits for the host. Every other step (prefills, chunked prefills,
batches larger than the largest size) runs op by op.

At start-up (`warm_up`) every size up to the engine's `max_num_seqs` is captured, largest first so
the smaller graphs reuse its memory pool, and the time that took is logged; a size the warm-up did
not cover is captured on first use.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from candelabra.backends.cuda.step import CudaStep
from candelabra.backends.torch.backend import device_token_ids, feed_tokens, torch
from candelabra.core.contract.executor import StepExecutor, StepInputs, StepResult, TokenFeed, pad_step_inputs
from candelabra.core.contract.ops import KVCache

log = logging.getLogger("candelabra")

# Padded batch sizes a decode step is captured at: every size up to 8, then steps of 8 and 16, so a
# batch pads by at most 16 rows.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def capture_size(num_tokens: int, largest: int) -> int | None:
    """The smallest capture size holding `num_tokens` decodes, or None when none up to `largest` does."""
    for size in CAPTURE_SIZES:
        if size > largest:
            return None
        if size >= num_tokens:
            return size
    return None


def is_plain_decode(inputs: StepInputs) -> bool:
    """One token per sequence, each sampled once, in order: the steps a graph replays."""
    step = inputs.step
    return (step.max_query_len == 1 and inputs.num_rows == step.num_tokens and inputs.scoring is None
            and np.array_equal(step.logits_rows, np.arange(step.num_tokens)))


class StaticDecode:
    """Persistent device buffers of one capture size: the step's tokens and metadata, refilled in
    place for every step, so a graph captured over them reads each new step's values.

    The int32 fields (tokens, positions, sequence lengths, block tables) are views of one device buffer
    and the int64 ones (slots, rotary positions) of another, each staged in a host buffer of the same
    layout (pinned on a GPU): a step is two host-to-device copies. Of the block tables, only the columns
    the step's longest sequence uses are copied; the kernels read no column past a sequence's length."""

    def __init__(self, size: int, block_table_width: int, block_size: int, device) -> None:
        self.size, self.width, self.block_size = size, block_table_width, block_size
        device = torch.device(device)
        pinned = device.type == "cuda"
        narrow = 3 * size + size * block_table_width  # tokens, positions, seq_lens, then the tables
        self._narrow_host = torch.zeros(narrow, dtype=torch.int32, pin_memory=pinned)
        self._wide_host = torch.zeros(2 * size, dtype=torch.int64, pin_memory=pinned)  # slots, rope positions
        self._narrow = torch.zeros(narrow, dtype=torch.int32, device=device)
        self._wide = torch.zeros(2 * size, dtype=torch.int64, device=device)
        # the host buffers are refilled only once the previous step's copies out of them are done
        self._copied = torch.cuda.Event() if pinned else None
        self.step = CudaStep.prepare(_empty_decode(size, block_table_width, block_size), device)
        views = self._views(self._narrow, self._wide)
        self.token_ids = views["token_ids"]
        views["token_positions"].copy_(self.step.token_positions)
        views["seq_lens"].copy_(self.step.seq_lens)
        views["block_tables"].copy_(self.step.block_tables)
        views["slot_mapping"].copy_(self.step.slot_mapping)
        views["rope_positions"].copy_(self.step.rope_positions)
        for name in ("token_positions", "seq_lens", "block_tables", "slot_mapping", "rope_positions"):
            setattr(self.step, name, views[name])
        self.logits = None  # the graph's output, once captured

    def _views(self, narrow, wide) -> dict:
        size, width = self.size, self.width
        return {"token_ids": narrow[:size], "token_positions": narrow[size:2 * size],
                "seq_lens": narrow[2 * size:3 * size], "block_tables": narrow[3 * size:].view(size, width),
                "slot_mapping": wide[:size], "rope_positions": wide[size:]}

    def load(self, inputs: StepInputs) -> StepInputs:
        """Copy `inputs`, padded to this size, into the buffers; the padded inputs."""
        padded = pad_step_inputs(inputs, self.size, self.size, self.size)
        meta = padded.step
        used = meta.block_tables.shape[1]
        if self._copied is not None:
            self._copied.synchronize()
        host = self._views(self._narrow_host, self._wide_host)
        for name, values in (("token_ids", padded.token_ids), ("token_positions", meta.positions),
                             ("seq_lens", meta.seq_lens), ("slot_mapping", meta.slot_mapping),
                             ("rope_positions", meta.rope_positions)):
            host[name].numpy()[:] = values
        # the used columns, packed at the front of the tables' host space, then spread on the device
        packed = self._narrow_host[3 * self.size:3 * self.size + self.size * used]
        packed.numpy()[:] = np.asarray(meta.block_tables, dtype=np.int32).reshape(-1)
        self._narrow[:3 * self.size].copy_(self._narrow_host[:3 * self.size], non_blocking=True)
        self._wide.copy_(self._wide_host, non_blocking=True)
        self.step.block_tables[:, :used].copy_(packed.view(self.size, used), non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return padded


def _empty_decode(size: int, width: int, block_size: int):
    """A decode step of `size` one-token sequences, each at position 0 of block 0 and writing no
    K/V: the buffers' shapes, the fields no decode changes (query offsets, token owners, logits
    rows), and until the first real step a step that the warm-up can run without touching the cache."""
    from candelabra.core.contract.step_metadata import NO_SLOT, StepMetadata

    return StepMetadata.build([1] * size, [1] * size, [[0] * width] * size, block_size, width,
                              slot_mapping=np.full(size, NO_SLOT, np.int32))


class CudaGraphExecutor(StepExecutor):
    """Plain decode steps of up to `max_batch` sequences from CUDA graphs; the rest op by op.

    With `capture=False` the same padded persistent buffers are used but the forward runs op by op
    on them each time: what the graphs replay, checkable where no GPU is (the tests)."""

    def __init__(self, backend: Any, model: Any, max_batch: int = CAPTURE_SIZES[-1], capture: bool = True) -> None:
        super().__init__(backend, model)
        self.max_batch, self.capture = max_batch, capture
        self._static: dict[tuple[int, int], StaticDecode] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._capture_seconds: dict[tuple[int, int], float] = {}

    def warm_up(self, caches: list[KVCache], max_num_seqs: int) -> None:
        """Capture the decode step at every size a batch of up to `max_num_seqs` pads to (at most
        `max_batch`), on buffers that write no K/V, largest first; log the time it took."""
        largest = capture_size(min(max_num_seqs, self.max_batch), self.max_batch)
        sizes = [size for size in CAPTURE_SIZES if size <= largest][::-1]
        block_size = int(caches[0].key.shape[1])
        start = time.perf_counter()
        with torch.inference_mode():
            for size in sizes:
                key = (size, block_size)
                static = self._static_buffers(key)
                if self.capture:
                    self._capture(key, static, caches)
                else:
                    self._forward(static, caches)
        what = "captured" if self.capture else "run op by op"
        log.info("cuda graphs: decode steps of %d to %d sequences (%d sizes) %s in %.1f s", sizes[-1], sizes[0],
                 len(sizes), what, time.perf_counter() - start)

    def run(self, inputs: StepInputs, caches: list[KVCache], feed: TokenFeed | None = None):
        with torch.inference_mode():
            size = capture_size(inputs.step.num_tokens, self.max_batch) if is_plain_decode(inputs) else None
            width = self._block_table_width(inputs.step.block_size)
            if size is None or inputs.step.block_tables.shape[1] > width:
                return super().run(inputs, caches, feed)
            key = (size, inputs.step.block_size)
            static = self._static_buffers(key)
            static.load(inputs)
            if feed is not None:
                feed_tokens(static.token_ids, feed)
            if not self.capture:
                logits = self._forward(static, caches)
            else:
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._capture(key, static, caches)
                    log.info("cuda graph: captured the decode step for %d sequences on first use in %.0f ms",
                             size, self._capture_seconds[key] * 1e3)
                graph.replay()
                logits = static.logits
            sampling = self.backend.prepare_sampling(inputs.sampling)
            return StepResult(self.backend.ops.sample(logits[: inputs.num_rows], sampling)), caches

    def token_ids(self, inputs: StepInputs, feed: TokenFeed | None):
        return device_token_ids(self.backend, inputs.token_ids, feed)

    def _static_buffers(self, key: tuple[int, int]) -> StaticDecode:
        static = self._static.get(key)
        if static is None:
            size, block_size = key
            static = self._static[key] = StaticDecode(size, self._block_table_width(block_size), block_size,
                                                      self.backend.torch_device)
        return static

    def _block_table_width(self, block_size: int) -> int:
        return math.ceil(self.model.config.max_position_embeddings / block_size)

    def _forward(self, static: StaticDecode, caches: list[KVCache]):
        hidden, _ = self.model.forward(static.token_ids, static.step, caches)
        return self.model.compute_logits(hidden, static.step.logits_rows)

    def _capture(self, key: tuple[int, int], static: StaticDecode, caches: list[KVCache]):
        """Warm up on a side stream (kernel compilation, autotuning, workspaces), then capture."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(static, caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static.logits = self._forward(static, caches)
        torch.cuda.synchronize()
        self._capture_seconds[key] = time.perf_counter() - start
        self._graphs[key] = graph
        log.debug("cuda graph: captured the decode step for %d sequences in %.0f ms", key[0],
                  self._capture_seconds[key] * 1e3)
        return graph
