"""Each member's rows of the wide model's cache: member m's calls on its view equal the same calls on a cache of
its own, and the merged cache holds every member's state, member-major (key/value layers, full and sliding, and the
conv and recurrent states of linear-attention layers, which a Mamba mixer reads as its past)."""

import pytest
import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    LinearAttentionLayer,
    StaticCache,
    StaticLayer,
)

from hf_wide.fold import Fold
from hf_wide.primitives import member_cache
from hf_wide.primitives.fallback import run_per_member

N, B, H, D, K = 3, 2, 2, 4, 3  # members, rows per member, heads, head dim, conv kernel


def layers():
    return [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=3), LinearAttentionLayer()]


def step(cache, states: dict, rows: slice) -> list[torch.Tensor]:
    """What a model's layers do to the cache in one forward; the tensors they get back."""
    keys, values, conv, recurrent = (states[k][rows] for k in ("keys", "values", "conv", "recurrent"))
    got = [*cache.update(keys, values, 0), *cache.update(keys + 1, values + 1, 1)]
    layer = cache.layers[2]
    got.append(layer.update_conv_state(conv, conv_kernel_size=K))
    got.append(layer.update_recurrent_state(recurrent))
    return got


def new_states(tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"keys": torch.randn(N * B, H, tokens, D, generator=gen),
            "values": torch.randn(N * B, H, tokens, D, generator=gen),
            "conv": torch.randn(N * B, 5, tokens, generator=gen),
            "recurrent": torch.randn(N * B, 5, 7, generator=gen)}


def test_each_member_sees_and_extends_only_its_own_rows():
    wide = DynamicCache()
    wide.layers = layers()
    own = []
    for m in range(N):
        own.append(DynamicCache())
        own[-1].layers = layers()
    for seed, tokens in enumerate([4, 1, 1]):  # a prefill, then two decoding steps
        states = new_states(tokens, seed)
        views = member_cache.split(wide, N, B)
        for m, view in enumerate(views):
            rows = slice(m * B, (m + 1) * B)
            for got, want in zip(step(view, states, rows), step(own[m], states, rows), strict=True):
                assert torch.equal(got, want)
        member_cache.merge(wide, views)
        for i in range(2):
            assert torch.equal(wide.layers[i].keys, torch.cat([c.layers[i].keys for c in own]))
            assert torch.equal(wide.layers[i].values, torch.cat([c.layers[i].values for c in own]))
        for name in ("conv_states", "recurrent_states"):
            assert torch.equal(getattr(wide.layers[2], name)[0], torch.cat([getattr(c.layers[2], name)[0] for c in own]))
        assert wide.layers[2].has_previous_state[0]
        assert wide.get_seq_length() == own[0].get_seq_length()


def test_states_written_in_place_keep_their_tensor():
    wide = DynamicCache()
    wide.layers = [LinearAttentionLayer()]
    wide.layers[0].update_conv_state(torch.randn(N * B, 5, 4), conv_kernel_size=K)  # (N*B, 5, K) once prefilled
    before = wide.layers[0].conv_states[0]
    new = torch.randn(N * B, 5, 1)
    want = torch.cat([before, new], -1)[..., -K:]  # the last K positions, the new one last
    views = member_cache.split(wide, N, B)
    for m, view in enumerate(views):
        view.layers[0].update_conv_state(new[m * B : (m + 1) * B])
    member_cache.merge(wide, views)
    assert wide.layers[0].conv_states[0] is before  # a static address stays one (CUDA graphs rely on it)
    assert torch.equal(before, want)


def test_layers_a_member_adds_are_added_with_every_members_rows():
    wide = DynamicCache()  # makes its layers as they are first updated
    states = new_states(2, 0)
    views = member_cache.split(wide, N, B)
    for m, view in enumerate(views):
        view.update(states["keys"][m * B : (m + 1) * B], states["values"][m * B : (m + 1) * B], 1)
    member_cache.merge(wide, views)
    assert len(wide.layers) == 2 and wide.layers[1].keys.shape[0] == N * B
    assert torch.equal(wide.layers[1].keys, states["keys"])


def test_an_encoder_decoder_cache_splits_both_caches_and_its_flags():
    wide = EncoderDecoderCache(DynamicCache(), DynamicCache())
    states = new_states(2, 0)
    views = member_cache.split(wide, N, B)
    for m, view in enumerate(views):  # what a cross-attention does on its first call
        rows = slice(m * B, (m + 1) * B)
        view.self_attention_cache.update(states["keys"][rows], states["values"][rows], 0)
        view.cross_attention_cache.update(states["values"][rows], states["keys"][rows], 0)
        view.is_updated[0] = True
    assert not wide.is_updated  # the members' flags are their own until merged
    member_cache.merge(wide, views)
    assert torch.equal(wide.self_attention_cache.layers[0].keys, states["keys"])
    assert torch.equal(wide.cross_attention_cache.layers[0].keys, states["values"])
    assert wide.is_updated == {0: True}


def test_a_member_handing_its_view_back_hands_back_the_cache():
    # A decoder run member by member returns past_key_values: the caller must get the cache, not member 0's rows
    cache = DynamicCache()
    x = torch.randn(N * B, H, 1, D)

    def decoder(x, cache):
        cache.update(x, x, 0)
        return x * 2, cache

    out, returned = run_per_member(Fold(N), [decoder] * N, False, (x, cache), {})
    assert returned is cache and torch.equal(cache.layers[0].keys, x) and torch.equal(out, x * 2)


def test_caches_the_members_made_themselves_are_gathered_member_major():
    # A decoder run member by member, asked for a cache and handed none: each member makes its own of B rows
    x = torch.randn(N * B, H, 2, D)

    def decoder(x):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        cache.self_attention_cache.update(x, x + 1, 0)
        cache.cross_attention_cache.update(x * 2, x * 3, 0)
        cache.is_updated[0] = True
        return x * 2, cache

    out, cache = run_per_member(Fold(N), [decoder] * N, False, (x,), {})
    assert torch.equal(out, x * 2) and cache.get_seq_length() == 2 and cache.is_updated == {0: True}
    assert torch.equal(cache.self_attention_cache.layers[0].keys, x)
    assert torch.equal(cache.self_attention_cache.layers[0].values, x + 1)
    assert torch.equal(cache.cross_attention_cache.layers[0].values, x * 3)


def test_a_cache_made_under_vmap_leaves_it_with_every_members_rows():
    from torch import nn

    from hf_wide.primitives import VectorisedFallback

    class Decoder(nn.Module):  # a layer that makes its cache when asked for one
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, D)

        def forward(self, x, use_cache=False):
            keys = self.proj(x)  # (B, H, T, D)
            cache = DynamicCache() if use_cache else None
            if cache is not None:
                cache.update(keys, keys * 2, 0)
            return keys.sum(), cache

    torch.manual_seed(0)
    mods = [Decoder().eval() for _ in range(N)]
    wide = VectorisedFallback.from_modules(mods, Fold(N))
    x = torch.randn(N * B, H, 3, D)
    with torch.no_grad():
        _, cache = wide(x, use_cache=True)
        keys = cache.layers[0].keys  # a plain tensor of N*B rows, not one that escaped vmap
        for m, mod in enumerate(mods):
            rows = slice(m * B, (m + 1) * B)
            assert torch.allclose(keys[rows], mod.proj(x[rows]), atol=1e-6)
            assert torch.allclose(cache.layers[0].values[rows], mod.proj(x[rows]) * 2, atol=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda: _static(), "DynamicCache"),
    (lambda: DynamicCache(offloading=True), "offloading"),
    (lambda: _with_layer(StaticLayer(max_cache_len=8)), "StaticLayer"),
])
def test_what_cannot_be_split_is_refused(make, match):
    with pytest.raises(NotImplementedError, match=match):
        member_cache.split(make(), N, B)


def _static():
    from transformers import LlamaConfig

    return StaticCache(config=LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1), max_cache_len=8)


def _with_layer(layer):
    cache = DynamicCache()
    cache.layers = [layer]
    return cache
