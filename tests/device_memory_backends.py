"""Torch backends standing in for a device with memory of its own: torch's CPU device placed as a
device is (`DevicePlacement`, as tests/test_torch_placement.py does), so that what depends on the
host and the device being apart (experts in host memory) runs here, with CPU tensors."""

from candelabra.backends.cuda.backend import CudaBackend
from candelabra.backends.torch.backend import TorchBackend
from candelabra.backends.torch.placement import DevicePlacement


class TorchWithDeviceMemory(TorchBackend):
    name = "torch-device-memory"

    def __init__(self, device=None):
        super().__init__(device)
        self.placement = DevicePlacement(self.torch_device, self.distributed_backend)


class CudaWithDeviceMemory(CudaBackend):
    """The cuda backend's ops (through the Triton interpreter without a GPU) on the same stand-in."""

    name = "cuda-device-memory"

    def __init__(self, device=None):
        super().__init__(device)
        self.placement = DevicePlacement(self.torch_device, self.distributed_backend)
