"""upload_packed: several host arrays of one dtype reach the device as views of one copy, values and shapes intact."""

import numpy as np
import pytest
import torch

from batchgen.engine.upload import upload_packed


def _arrays(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-5, 1000, size=shape).astype(dtype) for shape in [(7,), (0,), (3, 5), (16,), (1,)]]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_every_array_arrives_with_its_values_shape_and_dtype(dtype):
    arrays = _arrays(dtype)
    uploaded = upload_packed(arrays, torch.device("cpu"), pinned=False)
    assert len(uploaded) == len(arrays)
    for host, device in zip(arrays, uploaded, strict=True):
        assert device.shape == host.shape
        assert device.numpy().dtype == host.dtype
        np.testing.assert_array_equal(device.numpy(), host)


def test_views_share_one_buffer_and_start_64_byte_aligned():
    uploaded = upload_packed(_arrays(np.int32), torch.device("cpu"), pinned=False)
    storages = {t.untyped_storage().data_ptr() for t in uploaded}
    assert len(storages) == 1
    assert all(t.data_ptr() % 64 == 0 for t in uploaded if t.numel())


def test_a_non_contiguous_array_is_copied_in_order():
    table = np.arange(24, dtype=np.int32).reshape(4, 6)[:, :3]
    (uploaded,) = upload_packed([table], torch.device("cpu"), pinned=False)
    np.testing.assert_array_equal(uploaded.numpy(), table)


def test_mixed_dtypes_are_refused():
    with pytest.raises(AssertionError, match="one dtype"):
        upload_packed([np.zeros(2, np.int64), np.zeros(2, np.int32)], torch.device("cpu"), pinned=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_upload_to_the_gpu():
    arrays = _arrays(np.int64)
    uploaded = upload_packed(arrays, torch.device("cuda"), pinned=True)
    torch.cuda.synchronize()
    for host, device in zip(arrays, uploaded, strict=True):
        assert device.is_cuda and device.data_ptr() % 16 == 0
        np.testing.assert_array_equal(device.cpu().numpy(), host)
