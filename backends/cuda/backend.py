"""The cuda backend: the torch backend on an NVIDIA GPU, with Triton kernels for the hot ops, int4
GGUF weights kept packed, and decode steps replayed from CUDA graphs.

With TRITON_INTERPRET=1 it runs on CPU tensors instead, every kernel through Triton's interpreter:
exact but slow, and in float32 and float16 only, since the interpreter gets bfloat16 arithmetic
wrong. That is how the kernels are tested without a GPU; `--backend auto` never picks it there.
"""

from __future__ import annotations

import logging
from typing import Any

from candelabra.backends.cuda.availability import cuda_missing, interpreter_broken, interpreting, triton_missing
from candelabra.backends.torch.backend import TorchBackend, TorchStepExecutor, torch
from candelabra.backends.torch.dtypes import torch_dtype
from candelabra.backends.torch.expert_weights import ExpertWeights
from candelabra.core.contract.backend import Probe
from candelabra.core.contract.dtypes import QUANTIZED_KV_DTYPES
from candelabra.core.contract.executor import StepExecutor
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import KVCache
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.contract.weights import QUANTIZABLE_ROLES, QuantizedTensor, WeightRole

log = logging.getLogger("candelabra")

GPU_DTYPES = ("bfloat16", "float16", "float32")
INTERPRETER_DTYPES = ("float32", "float16")
# Triton's float8e4nv, which the attention kernels read an fp8 cache through, is Ada's and Hopper's.
FP8_CAPABILITY = (8, 9)


class CudaBackend(TorchBackend):
    name = "cuda"
    # Its embedding op reads a dense table; int4 experts are kept one by one for the int4 GEMM, as linear
    # weights are (the torch backend's `upload_quantized_experts` over this `upload_quantized`).
    quantized_roles = QUANTIZABLE_ROLES | {WeightRole.EXPERTS}
    # A fused projection of parts in different formats arrives dense: its int4 GEMM takes one format a weight.
    keeps_row_stacks = False
    device_type = "cpu" if interpreting() else "cuda"
    dtypes = INTERPRETER_DTYPES if interpreting() else GPU_DTYPES
    distributed_backend = "gloo" if interpreting() else "nccl"  # the interpreter's tensors are CPU tensors

    @classmethod
    def probe(cls) -> Probe:
        if torch is None:
            return Probe(False, "torch is not installed; pip install 'candelabra[cuda]' with a CUDA build of torch")
        missing = triton_missing()
        if missing:
            return Probe(False, missing)
        if interpreting():
            broken = interpreter_broken()
            if broken:
                return Probe(False, broken)
            return Probe(True, priority=1, detail="CPU tensors through the Triton interpreter (TRITON_INTERPRET=1): "
                                                  "every kernel, slowly, for testing")
        missing = cuda_missing(torch)
        if missing:
            return Probe(False, missing)
        import triton

        gpu = torch.cuda.get_device_properties(0)
        memory = f"{gpu.total_memory / 2**30:.0f} GiB, compute capability {gpu.major}.{gpu.minor}"
        versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}"
        return Probe(True, priority=100, detail=f"{gpu.name} ({memory}; {versions})")

    @classmethod
    def device_count(cls) -> int:
        if interpreting() or torch is None or cuda_missing(torch):
            return 1
        return torch.cuda.device_count()

    @classmethod
    def kv_cache_dtypes(cls, compute_dtype):
        """The torch backend's float dtypes, and "int8" and "fp8" (kernels/kv_codes.py): write_kv quantizes
        each row as it stores it and attention multiplies the codes out as it reads them. Reading fp8 takes
        a GPU of compute capability 8.9 or later (Ada, Hopper), which `allocate_kv_cache` checks."""
        return (*super().kv_cache_dtypes(compute_dtype), *QUANTIZED_KV_DTYPES)

    @classmethod
    def ops_class(cls) -> type:
        from candelabra.backends.cuda.ops import CudaOps

        return CudaOps

    def _configure_device(self) -> None:
        if self.torch_device.type == "cpu":
            log.info("cuda backend on CPU tensors through the Triton interpreter: for testing, slow")
            return
        torch.cuda.set_device(self.torch_device)
        log.info("cuda backend on %s", torch.cuda.get_device_name(self.torch_device))

    # KV cache

    def allocate_kv_cache(self, spec: KVCacheSpec) -> list[KVCache]:
        if spec.dtype == "fp8" and self.torch_device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.torch_device)
            if capability < FP8_CAPABILITY:
                raise ValueError(f"an fp8 KV cache needs a GPU of compute capability {FP8_CAPABILITY[0]}."
                                 f"{FP8_CAPABILITY[1]} or later, for Triton's float8 e4m3; "
                                 f"{torch.cuda.get_device_name(self.torch_device)} has {capability[0]}."
                                 f"{capability[1]}: use --kv-cache-dtype int8")
        return super().allocate_kv_cache(spec)

    # weights

    def upload_quantized(self, name: str, weight: QuantizedTensor, dtype: str, role=None):
        """Q4_0, Q4_1, Q4_K and the grouped int4 formats (GPTQ, AWQ) stay int4 groups for the Triton GEMM;
        other formats are dequantized."""
        from candelabra.backends.cuda.quantized import INT4_FORMATS, Int4CudaWeight

        if weight.format in INT4_FORMATS:
            return Int4CudaWeight.from_quantized(weight, torch_dtype(dtype), self.torch_device)
        return self.to_device(weight.dequantize(), dtype)

    def activation_rounding(self) -> None:
        """None: the Triton kernels multiply x as given (and under the interpreter too, on CPU tensors, where the
        torch backend's CPU kernels that may round it are never chosen)."""
        return None

    # the step

    def step_executor(self, model: Any) -> StepExecutor:
        from candelabra.backends.cuda.gemv_tuning import tune_missing_shapes

        tune_missing_shapes(model, self.torch_device)  # before any graph captures the GEMV's tiling
        experts = [each for each in (getattr(layer, "experts", None) for layer in getattr(model, "layers", ()))
                   if each is not None]
        offloaded = any(getattr(each, "offloaded", None) is not None for each in experts)
        quantized = any(isinstance(each.gate_up, ExpertWeights) or isinstance(each.down, ExpertWeights)
                        for each in experts)
        why_not = why_no_graphs(self.torch_device.type, self.eager_steps, getattr(model, "communicator", None),
                                offloaded, quantized)
        if why_not is None:
            from candelabra.backends.cuda.graphs import CudaGraphExecutor

            return CudaGraphExecutor(self, model)
        if self.torch_device.type == "cuda":
            log.info("cuda backend: every step runs op by op, no CUDA graphs: %s", why_not)
        return TorchStepExecutor(self, model)

    def prepare_step(self, meta: StepMetadata):
        from candelabra.backends.cuda.step import CudaStep

        return CudaStep.prepare(meta, self.torch_device)


def why_no_graphs(device_type: str, eager_steps: bool, communicator: Any, offloads_experts: bool = False,
                  quantized_experts: bool = False) -> str | None:
    """Why decode steps are not replayed from CUDA graphs, or None when they are."""
    if device_type != "cuda":
        return "CPU tensors through the Triton interpreter"
    if eager_steps:
        return "--disable-cuda-graph"
    if communicator is not None and communicator.world_size > 1:
        # NCCL can be captured, but the all-reduces inside the step and the per-step broadcast of the
        # schedule have not been run under capture on a GPU yet: until then tensor-parallel steps stay eager.
        return f"tensor parallelism over {communicator.world_size} ranks (collectives inside a graph are unverified)"
    if offloads_experts:
        return ("experts in host memory (--num-experts-offload-per-rank: each MoE layer reads its routing on the host "
                "to copy the experts it picked in)")
    if quantized_experts:
        return ("experts kept quantized one by one (the fused MoE kernel takes dense experts; the per-expert path "
                "counts each expert's tokens on the host)")
    return None
