"""The roles of a fallback's inputs: a table or mask with N*B rows by chance is not cut into the members' rows."""

import pytest
import torch
import transformers
from families import members_from
from oracle import TOLERANCE
from torch import nn

from hf_wide import Kind, WideModel
from hf_wide.primitives import PerMemberFallback, VectorisedFallback
from hf_wide.samples import sample_inputs
from hf_wide.tracer import trace

N = 3


class Shift(nn.Module):
    """A member's scale, plus a table of the positions without the batch dim: ``(L, D)``."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.alpha = 1.0  # a plain attribute: where the members' differ, each runs its own module in a loop

    def forward(self, x, table):  # (B, L, D), (L, D)
        return x * self.scale * self.alpha + table


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.shift = Shift()

    def forward(self, x):
        h = self.inp(x)
        table = torch.arange(h.shape[1], dtype=h.dtype, device=h.device)[:, None].expand(-1, 4) * 0.1
        return self.shift(h, table)


def members(looped: bool) -> list[nn.Module]:
    built = []
    for i in range(N):
        torch.manual_seed(i)
        model = Net().eval()
        model.shift.alpha = 1.0 + i if looped else 1.0
        built.append(model)
    return built


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("looped", [True, False], ids=["loop", "vectorised"])
def test_a_table_with_as_many_rows_as_the_forward_is_every_members_whole(looped, verify):
    # At B=1 and L=N the table has the forward's N*B rows. Split by member, each member's one row of it broadcast over
    # its L positions: no shape disagreed, and member 1 was off by 0.1 (looped, verified or not; vectorised, where
    # this was the module's first call). The trace says the table does not carry the batch.
    models = members(looped)
    wide = WideModel.from_models(models, (torch.randn(2, 5, 4),), verify=verify)
    expected = PerMemberFallback if looped else VectorisedFallback
    assert isinstance(wide.model.shift, expected)
    assert wide.plan.entries["shift"].kind == (Kind.FALLBACK if looped else Kind.VECTORISED)
    for batch, length in [(1, N), (N, N * N), (2, 5), (1, 7)]:
        x = torch.randn(batch, length, 4)
        with torch.no_grad():
            got, want = wide(x), torch.stack([m(x) for m in models])
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOLERANCE, (batch, length)


def test_the_trace_tells_which_inputs_of_each_module_carry_the_batch():
    config = transformers.FunnelConfig(vocab_size=100, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1])
    model = transformers.FunnelModel(config).eval()
    roles = trace(model, (), sample_inputs(model)).roles
    (top,) = roles[""].values()
    assert top == [True, True]  # input_ids, attention_mask: one batch, though export gives each input a symbol
    (attention,) = roles["encoder.blocks.0.0.attention"].values()
    # query, key, value: the rows; the attention inputs: position embeddings (tables), the token types and the
    # mask (the rows) and the mask of the first token (T, T): not the rows
    assert attention[:3] == [True, True, True]
    assert False in attention[3:] and True in attention[3:]


def funnels(n: int = 2) -> list[nn.Module]:
    config = transformers.FunnelConfig(vocab_size=100, d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                       num_labels=3)
    built = []
    for seed in range(n):
        torch.manual_seed(seed)
        built.append(transformers.FunnelForSequenceClassification(config).eval())
    return built


def test_funnels_attentions_run_vectorised_with_their_tables_whole_and_keep_their_roles_in_a_repo(tmp_path):
    # Funnel's attention takes a (T, T) mask of the first token and position tables beside the rows: at T == N*B
    # the mask was split by member. Its encoder, which builds the mask with ``new_ones``, ran vectorised whole.
    models = funnels()
    wide = WideModel.from_models(models)
    attention = "funnel.encoder.blocks.0.0.attention"
    assert wide.plan.entries[attention].kind == Kind.VECTORISED
    assert "funnel.encoder" not in wide.plan.entries
    wide.save_pretrained(tmp_path)
    back = WideModel.from_pretrained(str(tmp_path))
    assert back.model.get_submodule(attention).input_roles == back.plan.input_roles[attention] != {}
    for batch, length in [(2, 4), (3, 6), (1, 5)]:  # T == N*B, as the first two
        ids = torch.randint(5, 100, (batch, length))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            want = torch.stack([m(**inputs).logits for m in models])
            for model in (wide, back):
                assert (model(**inputs).logits - want).abs().max() <= TOLERANCE, (batch, length)


class Positions(nn.Module):
    """Position vectors for a ``(B, L)`` size, as ProphetNet's take ``inputs_embeds.shape[:2]``: the size holds the
    rows."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))
        self.alpha = 1.0

    def forward(self, shape):
        return self.table[: shape[1]].expand(shape[0], -1, -1) * self.alpha  # (B, L, 4)


class Sized(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.positions = Positions()

    def forward(self, x):
        h = self.inp(x)
        return h + self.positions(h.shape[:2])


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("looped", [True, False], ids=["loop", "vectorised"])
def test_a_size_of_the_rows_is_each_members_share_of_it(looped, verify):
    # Handed (N*B, L), each member made N*B rows of positions: N*N*B in all, which failed unverified and moved the
    # whole model into a loop verified. The trace says the size holds the batch: each member is given B.
    models = []
    for i in range(N):
        torch.manual_seed(i)
        models.append(Sized().eval())
        models[-1].positions.alpha = 1.0 + i if looped else 1.0
    wide = WideModel.from_models(models, (torch.randn(2, 5, 4),), verify=verify)
    assert wide.plan.entries["positions"].kind == (Kind.FALLBACK if looped else Kind.VECTORISED)
    for batch, length in [(1, N), (3, 2), (2, 7)]:
        x = torch.randn(batch, length, 4)
        with torch.no_grad():
            got, want = wide(x), torch.stack([m(x) for m in models])
        assert got.shape == want.shape and (got - want).abs().max() <= TOLERANCE, (batch, length)


def test_prophetnets_positions_get_each_members_size_unverified():
    config = transformers.ProphetNetConfig(
        vocab_size=64, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=4, num_decoder_attention_heads=4, ngram=2,
        max_position_embeddings=32, pad_token_id=0)
    models = members_from(transformers.ProphetNetForConditionalGeneration, config, range(2))
    wide = WideModel.from_models(models, verify=False)
    assert wide.plan.entries["prophetnet.encoder.position_embeddings"].kind == Kind.VECTORISED
    inputs = {"input_ids": torch.randint(3, 64, (3, 6)), "decoder_input_ids": torch.randint(3, 64, (3, 5))}
    with torch.no_grad():
        got, want = wide(**inputs).logits, torch.stack([m(**inputs).logits for m in models])
    assert (got - want).abs().max() <= TOLERANCE
