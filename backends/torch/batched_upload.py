"""Many small host arrays to a device in one copy.

A step's sampling parameters are a dozen arrays of a few bytes each. Copied one by one from pageable
memory, each is its own transfer with its own fixed cost, paid by the host while the GPU waits at the
end of a step. Packed into one buffer (pinned on a GPU, from torch's caching host allocator, so it is
reused once its copy is done) they are one transfer, and each array is a view of the device copy.
"""

from __future__ import annotations

import numpy as np
import torch

# Every array starts at a multiple of this many bytes, so each view is aligned for its dtype.
ALIGNMENT = 16

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32,
                 torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_}


def upload(arrays: list[tuple[np.ndarray, torch.dtype]], device: torch.device,
           pack: bool | None = None) -> list[torch.Tensor]:
    """Each array as a tensor of its dtype on `device`, in order. Off the CPU (or with `pack`), the
    arrays travel packed in one host buffer and one copy; on the CPU each is wrapped, converted only
    where its dtype differs."""
    if pack is None:
        pack = device.type != "cpu"
    converted = [np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[dtype]) for array, dtype in arrays]
    if not pack:
        return [torch.from_numpy(array) for array in converted]
    offsets, total = [], 0
    for array in converted:
        offsets.append(total)
        total += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    host = torch.empty(max(total, ALIGNMENT), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staged = host.numpy()
    for array, offset in zip(converted, offsets):
        staged[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return [on_device[offset:offset + array.nbytes].view(dtype).view(array.shape)
            for array, offset, (_, dtype) in zip(converted, offsets, arrays)]
