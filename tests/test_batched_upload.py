"""Small host arrays packed into one buffer and copied at once come back as they went in."""

import numpy as np
import pytest
import torch

from candelabra.backends.torch.batched_upload import ALIGNMENT, upload


@pytest.mark.parametrize("pack", [True, False])
def test_every_array_comes_back_with_its_values_dtype_and_shape(pack):
    rng = np.random.default_rng(5)
    arrays = [(rng.random(3), torch.float32), (rng.integers(-9, 9, (2, 5)), torch.int64),
              (rng.random(7), torch.float64), (np.zeros(0), torch.int64),
              (rng.integers(0, 2**31 - 1, (4, 3)), torch.int32), (rng.random(1) > 0.5, torch.bool),
              (rng.random(5), torch.float32)]
    tensors = upload(arrays, torch.device("cpu"), pack=pack)
    assert len(tensors) == len(arrays)
    for (array, dtype), tensor in zip(arrays, tensors):
        assert tensor.dtype == dtype and tuple(tensor.shape) == array.shape
        expected = torch.from_numpy(np.asarray(array)).to(dtype)
        assert torch.equal(tensor, expected)
    if pack:  # views of one buffer, each starting aligned
        storage = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(storage) == 1
        assert all((t.data_ptr() - tensors[0].data_ptr()) % ALIGNMENT == 0 for t in tensors)


def test_packed_arrays_are_copies_that_later_host_writes_do_not_reach():
    values = np.arange(6, dtype=np.float32)
    (tensor,) = upload([(values, torch.float32)], torch.device("cpu"), pack=True)
    values[:] = -1
    assert tensor.tolist() == [0, 1, 2, 3, 4, 5]


def test_nothing_to_upload_is_an_empty_list():
    assert upload([], torch.device("cpu"), pack=True) == []
