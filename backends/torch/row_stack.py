"""A fused projection whose parts are stored in different formats (the core's `RowStack`), kept part by part."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from candelabra.backends.torch.weight_forms import KeptWeight


class RowStackWeight:
    """The parts of a fused projection [N, K], each as `upload_quantized` kept it (a `KeptWeight`, in the form
    and kernels the kernel table names for its own format, or a dense tensor): x @ W.T is their
    products side by side."""

    def __init__(self, parts: list[KeptWeight | torch.Tensor]) -> None:
        widths = {part.shape[1] for part in parts}
        if len(parts) < 2 or len(widths) != 1:
            raise ValueError("a row stack is two or more weights of one width, got shapes "
                             f"{[tuple(part.shape) for part in parts]}")
        self.parts = tuple(parts)
        self.shape = (sum(part.shape[0] for part in parts), widths.pop())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the compute dtype to x @ W.T [..., N]."""
        return torch.cat([part.matmul(x) if isinstance(part, KeptWeight) else F.linear(x, part) for part in self.parts],
                         dim=-1)
