"""A backend is constructed for a device: which devices exist, and how --device-ids and LLM pick one."""

import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.backends.metal import MetalBackend
from candelabra.conformance.engine_cases import write_tiny_checkpoint
from candelabra.core.contract.device import Device
from support import run_candelabra


def test_a_device_is_an_index_with_rank_and_world_size_reserved():
    assert Device() == Device(0, 0, 1)
    with pytest.raises(ValueError, match="a device index is 0 or more, not -1"):
        Device(-1)
    with pytest.raises(ValueError, match="rank 2 is not one of world size 2"):
        Device(0, rank=2, world_size=2)


@pytest.mark.parametrize("backend_class", [CpuBackend, MetalBackend])
def test_in_tree_backends_run_on_device_0_and_name_the_devices_they_have(backend_class):
    if not backend_class.probe().available:
        pytest.skip(backend_class.probe().reason)
    assert backend_class().device == Device(0)
    assert backend_class(Device(0)).device == Device(0)
    with pytest.raises(ValueError) as caught:
        backend_class(Device(1))
    assert str(caught.value) == f"backend {backend_class.name!r} has no device 1; it has one device, 0"


def test_a_backend_with_several_devices_accepts_each_and_refuses_the_next():
    class FourCpus(CpuBackend):
        name = "fourcpus"

        @classmethod
        def device_count(cls):
            return 4

    assert FourCpus(Device(3)).device.index == 3
    with pytest.raises(ValueError, match="backend 'fourcpus' has no device 4; it has devices 0 to 3"):
        FourCpus(Device(4))


@pytest.mark.parametrize("ids, expected", [(None, ()), ("", ()), ("0", (0,)), (" 2 ", (2,)), ("0,1", (0, 1)),
                                           ("3, 1", (3, 1))])
def test_device_ids_name_devices_by_index(ids, expected):
    assert Device.parse_ids(ids) == expected


@pytest.mark.parametrize("ids, problem", [
    ("cuda:0", "--device-ids cuda:0: a device is a number, 0 or more"),
    ("-1", "--device-ids -1: a device is a number, 0 or more"),
    ("0,0", "--device-ids 0,0: a device is named twice"),
])
def test_device_ids_that_name_no_device_are_refused(ids, problem):
    with pytest.raises(ValueError) as caught:
        Device.parse_ids(ids)
    assert str(caught.value).startswith(problem)


def test_llm_constructs_its_backend_for_the_device_it_is_given(tiny_llm):
    assert tiny_llm(seed=3, device=0).backend.device == Device(0)
    assert tiny_llm(seed=3, backend=CpuBackend).backend.device == Device(0)
    with pytest.raises(ValueError, match="backend 'cpu' has no device 1"):
        tiny_llm(seed=3, device=Device(1))


def test_serve_refuses_a_device_the_backend_lacks_before_loading(tmp_path):
    write_tiny_checkpoint(tmp_path, seed=3)
    result = run_candelabra("serve", "--weight-path", str(tmp_path), "--backend", "cpu", "--device-ids", "1",
                            "--port", "0")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "error: backend 'cpu' has no device 1; it has one device, 0"
    assert "loading" not in result.stderr
