"""The packed layout of hf_wide.packing: a batch's real tokens, member-major, and back."""

import threading

import torch

from hf_wide.packing import Packing, active, packed, worth_packing

MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])  # B=3, T=4: 7 real tokens


def test_pack_keeps_the_real_tokens_of_every_member_in_order_and_unpack_puts_them_back():
    n, b, t, d = 2, *MASK.shape, 5
    x = torch.randn(n * b, t, d)
    packing = Packing.of(MASK)
    packed_x = packing.pack(x)
    assert packed_x.shape == (n, 7, d)
    real = MASK.bool()
    for m in range(n):
        assert torch.equal(packed_x[m], x[m * b:(m + 1) * b][real])
    back = packing.unpack(packed_x)  # (N*B, T, D)
    assert back.shape == x.shape
    assert torch.equal(back.view(n, b, t, d)[:, real], x.view(n, b, t, d)[:, real])
    assert torch.count_nonzero(back.view(n, b, t, d)[:, ~real]) == 0  # zeros, never uninitialised memory


def test_a_packed_call_is_this_threads_alone_and_ends_with_its_block():
    seen = {}
    with packed(MASK) as state:
        state.inside = True
        assert active() is not None
        other = threading.Thread(target=lambda: seen.update(other=active()))
        other.start()
        other.join()
    assert seen["other"] is None
    assert active() is None


def test_only_batches_with_enough_padding_are_packed():
    assert worth_packing(MASK)  # 5 of 12 positions padded
    assert not worth_packing(torch.ones(4, 8, dtype=torch.long))
    assert not worth_packing(torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))  # 1 of 8
