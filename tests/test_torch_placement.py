"""Where a torch backend's tensors live decides its memory policy, chosen once: the CPU (and a device
backend standing in on it) keeps them in host RAM; a device's own memory returns results in one packed
copy that unpacks to the same arrays."""

import numpy as np
import torch

from candelabra.backends.torch.backend import TorchBackend
from candelabra.backends.torch.placement import DevicePlacement, HostPlacement
from candelabra.core.contract.kv_cache import KVCacheSpec


def test_the_cpu_keeps_its_tensors_in_host_ram_with_a_quarter_of_it_for_the_kv_cache():
    backend = TorchBackend()
    assert isinstance(backend.placement, HostPlacement)
    assert backend.kv_cache_fraction() == 0.25 and backend.kv_cache_committed_on_write()
    assert backend.max_num_batched_tokens() == 512
    caches = backend.allocate_kv_cache(KVCacheSpec(2, 3, 16, 2, 8, "float32"))
    assert len(caches) == 2 and caches[0].key.shape == (3, 16, 2, 8) and not caches[0].key.any()


def test_a_device_returns_its_results_in_one_packed_copy_that_unpacks_to_the_same_arrays():
    rng = np.random.default_rng(5)
    tensors = [torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
               torch.from_numpy(rng.integers(-9, 9, 7).astype(np.int32)),
               torch.from_numpy(rng.standard_normal((2, 4)).astype(np.float32)).to(torch.bfloat16),
               torch.from_numpy(rng.integers(0, 9, (2, 3)))]
    backend = TorchBackend()
    placement = DevicePlacement(torch.device("cpu"), "gloo")
    fetched = placement.fetch(backend.to_host, tensors)
    assert len(fetched) == len(tensors)
    for got, tensor in zip(fetched, tensors):
        expected = backend.to_host(tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    assert placement.kv_cache_fraction == 0.5 and not placement.kv_cache_committed_on_write


def test_a_fetch_begun_on_a_device_keeps_the_values_it_began_with():
    """`start_fetch` copies at once (queued behind the step on a GPU): a later step that overwrites the
    tensors before the host reads them changes nothing it returns."""
    backend = TorchBackend()
    placement = DevicePlacement(torch.device("cpu"), "gloo")
    tokens, logprobs = torch.arange(6, dtype=torch.int32), torch.linspace(-3, 0, 6)
    finish = placement.start_fetch(backend.to_host, [tokens, logprobs])
    tokens.fill_(-1)
    logprobs.zero_()
    got_tokens, got_logprobs = finish()
    np.testing.assert_array_equal(got_tokens, np.arange(6, dtype=np.int32))
    np.testing.assert_array_equal(got_logprobs, np.linspace(-3, 0, 6, dtype=np.float32))
