"""upload_packed: several host arrays reach the device as views of one copy, values, shapes and dtypes intact."""

import numpy as np
import pytest
import torch

from batchgen.worker.upload import upload_packed


def _arrays(dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-5, 1000, size=shape).astype(dtype) for shape in [(7,), (0,), (3, 5), (16,), (1,)]]


def _mixed_arrays() -> list[np.ndarray]:
    """Alternating dtypes of 8 and 4 bytes, with sizes that leave every offset unaligned unless padded."""
    return [array for pair in zip(_arrays(np.int64), _arrays(np.int32), strict=True) for array in pair]


@pytest.mark.parametrize("arrays", [_arrays(np.int64), _arrays(np.int32), _mixed_arrays()],
                         ids=["int64", "int32", "mixed"])
def test_every_array_arrives_with_its_values_shape_and_dtype(arrays):
    uploaded = upload_packed(arrays, torch.device("cpu"), pinned=False)
    assert len(uploaded) == len(arrays)
    for host, device in zip(arrays, uploaded, strict=True):
        assert device.shape == host.shape
        assert device.numpy().dtype == host.dtype
        np.testing.assert_array_equal(device.numpy(), host)


def test_views_share_one_buffer_and_start_64_byte_aligned():
    uploaded = upload_packed(_mixed_arrays(), torch.device("cpu"), pinned=False)
    storages = {t.untyped_storage().data_ptr() for t in uploaded}
    assert len(storages) == 1
    assert all(t.data_ptr() % 64 == 0 for t in uploaded if t.numel())


def test_a_non_contiguous_array_is_copied_in_order():
    table = np.arange(24, dtype=np.int32).reshape(4, 6)[:, :3]
    (uploaded,) = upload_packed([table], torch.device("cpu"), pinned=False)
    np.testing.assert_array_equal(uploaded.numpy(), table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_upload_to_the_gpu():
    arrays = _mixed_arrays()
    uploaded = upload_packed(arrays, torch.device("cuda"), pinned=True)
    torch.cuda.synchronize()
    for host, device in zip(arrays, uploaded, strict=True):
        assert device.is_cuda and device.data_ptr() % 16 == 0
        np.testing.assert_array_equal(device.cpu().numpy(), host)
