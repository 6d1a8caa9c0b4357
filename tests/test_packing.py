"""The packed layout of hf_wide.packing: a batch's real tokens, member-major, and back."""

import threading

import torch

from hf_wide.packing import Packing, _enter_last, active, keys_from, packed, worth_packing

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


def test_each_position_knows_its_packed_token_and_each_row_its_first():
    packing = Packing.of(MASK)
    assert packing.source.tolist() == [0, 1, 2, 3, 4, 5, 7, 7, 6, 7, 7, 7]  # 7: the row of zeros past the K tokens
    assert packing.firsts.tolist() == [0, 4, 6]
    x = torch.randn(2, 3, 5)  # (N, B, D): each row's first token
    back = packing.unpack_firsts(x).view(2, 3, 4, 5)
    assert torch.equal(back[:, :, 0], x)
    assert torch.count_nonzero(back[:, :, 1:]) == 0


def test_a_batch_padded_on_the_left_has_no_first_tokens_to_run_alone():
    assert Packing.of(MASK.flip(1)).firsts is None  # row 1's first position is padding
    with packed(MASK.flip(1), first_tokens=True) as state:
        state.inside = True
        hidden = torch.randn(2, 7, 5)
        assert _enter_last(None, (hidden,), {}) is None  # the last layer runs on every token
        assert keys_from() is None
