"""A backend that takes over step execution the way a graph-capturing one does: every step runs
at a fixed size from a small set (padded with `pad_step_inputs`), and the sampled rows are cut
back to the real ones before they leave the executor."""

from __future__ import annotations

from candelabra.backends.cpu.backend import CpuBackend
from candelabra.core.contract.executor import StepExecutor, StepInputs, pad_step_inputs
from candelabra.core.contract.ops import SampleResult

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def bucket(count: int) -> int:
    return next(size for size in SIZES if size >= count)


class PaddingExecutor(StepExecutor):
    def __init__(self, backend, model) -> None:
        super().__init__(backend, model)
        self.shapes: list[tuple[int, int, int]] = []  # (tokens, sequences, rows) of every step run
        self.warm_ups: list[tuple[int, int]] = []  # (max_num_seqs, steps run before) of every warm-up

    def warm_up(self, caches, max_num_seqs: int) -> None:
        self.warm_ups.append((max_num_seqs, len(self.shapes)))

    def run(self, inputs: StepInputs, caches):
        real_rows = inputs.num_rows
        tokens = bucket(inputs.step.num_tokens + 1)  # at least one padding token, for padding rows to read
        padded = pad_step_inputs(inputs, tokens, inputs.step.num_seqs + tokens - inputs.step.num_tokens,
                                 bucket(real_rows) if real_rows else 0)
        self.shapes.append((padded.step.num_tokens, padded.step.num_seqs, padded.num_rows))
        result, caches = super().run(padded, caches)
        if result.sampled is None:
            return result, caches
        return result._replace(sampled=SampleResult(*(field[:real_rows] for field in result.sampled))), caches


class PaddedCpuBackend(CpuBackend):
    name = "padded-cpu"

    def step_executor(self, model) -> PaddingExecutor:
        return PaddingExecutor(self, model)
