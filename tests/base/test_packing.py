"""``base/packing.py``: tensors of mixed dtypes through one byte buffer and back."""
import pytest
import torch

from fxpipe.base.packing import ALIGN, pack, packed_nbytes, unpack


def test_mixed_dtypes_come_back_bit_for_bit_as_views_of_the_buffer():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randint(0, 50257, (7,), generator=gen),
               torch.tensor(True), torch.randn(3, generator=gen).bfloat16(), torch.randn((), generator=gen).double()]
    specs = [(t.shape, t.dtype) for t in tensors]
    buf = pack(tensors)
    # each part starts at a multiple of 8 bytes: 60 -> 64, 56, 1 -> 8, 6 -> 8, 8
    assert buf.dtype == torch.uint8 and buf.numel() == packed_nbytes(specs) == 64 + 56 + 8 + 8 + 8
    out = unpack(buf, specs)
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o.view(torch.uint8) if o.dim() else o.reshape(1).view(torch.uint8),
                           t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8))
        assert o.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view: no copy
        assert (o.storage_offset() * o.dtype.itemsize) % ALIGN == 0


def test_a_buffer_of_the_wrong_size_or_an_element_wider_than_the_alignment_is_refused():
    specs = [((4,), torch.float32)]
    with pytest.raises(ValueError, match="16 uint8 bytes expected, got 12"):
        unpack(torch.zeros(12, dtype=torch.uint8), specs)
    with pytest.raises(ValueError, match="cannot pack torch.complex128"):
        pack([torch.zeros(2, dtype=torch.complex128)])
