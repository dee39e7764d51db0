"""The backend contract: everything a backend implements and everything the core hands it.

`Backend` (memory, weights, KV cache, step metadata), `Ops` (the op interface, each op's exact
semantics in its docstring), `Communicator` (the collectives of tensor parallelism), the step and
sampling metadata, the KV cache spec, the dtypes, and weight roles and quantized weights.
"""

from candelabra.core.contract.backend import Backend, Probe
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.device import Device
from candelabra.core.contract.dtypes import FLOAT_DTYPES, DType
from candelabra.core.contract.executor import PromptScoring, StepExecutor, StepInputs, StepResult, pad_step_inputs
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.contract.ops import OP_NAMES, KVCache, OpNotSupported, Ops, SampleResult, Tensor, TokenLogprobs
from candelabra.core.contract.step_metadata import NO_SLOT, NO_TOKEN, SamplingMetadata, StepMetadata
from candelabra.core.contract.weights import QuantizedTensor, WeightRole

__all__ = [
    "FLOAT_DTYPES", "NO_SLOT", "NO_TOKEN", "OP_NAMES", "Backend", "Communicator", "DType", "KVCache", "KVCacheSpec",
    "OpNotSupported", "Device", "Ops", "Probe", "QuantizedTensor", "SampleResult", "SamplingMetadata", "StepExecutor",
    "PromptScoring", "StepInputs", "StepMetadata", "StepResult", "Tensor", "TokenLogprobs", "WeightRole",
    "pad_step_inputs",
]
