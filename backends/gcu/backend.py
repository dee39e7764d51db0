"""The gcu backend: the torch backend on Enflame's GCU through torch_gcu, with vLLM's custom kernels
where a vLLM build for the GCU registers them.

Everything else (memory, the paged KV cache in bfloat16 or float16, block copies, every other op)
is the torch backend's, on device type "gcu". Without the hardware, `CANDELABRA_STAND_IN=gcu` runs it
unchanged on torch's CPU device, the kernels then taken from `candelabra.backends.gcu.stand_in`.
"""

from __future__ import annotations

from candelabra.backends.gcu import kernels
from candelabra.backends.torch.accelerator import AcceleratorBackend, VendorKernel

# vLLM's custom ops, in its own calling convention (outputs passed in), as `import vllm._C` registers
# them with torch for the device its build targets. Automatic: where they are missing the torch op
# runs, and the reason is logged.
VLLM_OPS = "vllm._C"
STAND_IN = "candelabra.backends.gcu.stand_in"


class GcuBackend(AcceleratorBackend):
    name = "gcu"
    device_type = "gcu"
    extension = "torch_gcu"
    visible_devices_variable = "TOPS_VISIBLE_DEVICES"
    distributed_backend = "eccl"  # Enflame's collective library, registered with torch.distributed by torch_gcu
    device_dtypes = ("bfloat16", "float16", "float32")
    overrides = {
        "silu_and_mul": VendorKernel("torch.ops._C:silu_and_mul", adapt=kernels.gated_into_output,
                                     requires=VLLM_OPS),
        "rms_norm": VendorKernel("torch.ops._C:rms_norm", adapt=kernels.norm_into_output, requires=VLLM_OPS),
        "add_rms_norm": VendorKernel("torch.ops._C:fused_add_rms_norm", adapt=kernels.add_norm_in_place,
                                     requires=VLLM_OPS),
    }
    stand_in_modules = {"torch.ops._C": STAND_IN, VLLM_OPS: STAND_IN}
