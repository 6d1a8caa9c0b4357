"""Built wide modules checked where they run, on the wide forward's own inputs (hf_wide/verify_here.py): the
members' module outputs need not be recorded, and a module that does not agree there is still checked on its
members' own inputs, which alone may find it wrong."""

import pytest
import torch
from conftest import CASES
from oracle import TOLERANCE, max_member_error
from test_verify import Tilt, lora_members  # Tilt's wide class (wrong for its last member) registers with it
from torch import nn

from hf_wide import Kind, WideModel, verify
from hf_wide.samples import sample_inputs
from hf_wide.verify_here import agrees_here, checked_here


def spied(monkeypatch) -> list:
    """What verification records of the members: (member, the module paths it records) per forward of a member."""
    calls, record = [], verify.record_members

    def spy(references, paths, *args, **kwargs):
        calls.extend((id(r), tuple(paths)) for r in references)
        return record(references, paths, *args, **kwargs)

    monkeypatch.setattr(verify, "record_members", spy)
    return calls


def test_adapters_are_checked_in_one_wide_forward_with_no_module_recorded(monkeypatch):
    members = lora_members(n=3, alphas=(4, 8, 16))
    wide = WideModel.from_models(members, verify=False)
    assert {e.wide_class for e in wide.plan.by_kind(Kind.BLOCK)} == {"WideLoraLinear"}
    calls, forwards, forward = spied(monkeypatch), [], WideModel.forward

    def count(self, *args, **kwargs):
        forwards.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WideModel, "forward", count)
    assert verify.diagnose(wide, members, (), sample_inputs(members[0]))[0] == {}
    assert len(calls) == 3 and all(paths == () for _, paths in calls)  # each member's whole output, nothing else
    assert len(forwards) == 1
    monkeypatch.undo()
    assert max_member_error(wide, members, CASES["llama-causallm"].inputs(2, padded=True)) <= TOLERANCE


def test_a_builder_wrong_for_one_member_disagrees_here_and_is_confirmed_on_the_members_inputs(monkeypatch):
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 4), Tilt(4), nn.Linear(4, 2)).eval() for _ in range(3)]
    calls = spied(monkeypatch)
    wide = WideModel.from_models(members, torch.randn(2, 4))
    assert "LastMemberForgotten disagreed" in wide.plan.entries["1"].reason
    assert ("1",) in {paths for _, paths in calls}  # its members' inputs, recorded to check it on
    assert max((wide(x := torch.randn(5, 4))[i] - m(x)).abs().max().item() for i, m in enumerate(members)) <= TOLERANCE


def wide_linear(n=3):
    torch.manual_seed(0)
    members = [nn.Linear(4, 3) for _ in range(n)]
    return members, WideModel.from_models([nn.Sequential(m) for m in members], torch.randn(2, 4), verify=False)


def test_the_folded_rows_are_split_member_major_and_other_inputs_given_whole():
    members, wide = wide_linear()
    x = torch.randn(3 * 2, 5, 4)  # (N*B, S, D)
    with torch.no_grad():
        out = wide.model[0](x)
    assert agrees_here(members, (x,), {}, out, rows=6, tf32=False)
    flat = x.reshape(-1, 4)  # (N*B*S, D): tokens flattened, still member-major
    with torch.no_grad():
        assert agrees_here(members, (flat,), {}, wide.model[0](flat), rows=6, tf32=False)
    assert not agrees_here(members, (x,), {}, out.flip(0), rows=6, tf32=False)  # the members' rows swapped


def test_a_broadcast_input_is_given_to_every_member_whole():
    members, wide = wide_linear()
    table = torch.randn(5, 4)  # the same for every member: no rows of its own
    with torch.no_grad():
        expected = torch.stack([m(table) for m in members])  # (N, 5, 3): one per member
    assert agrees_here(members, (table,), {}, expected, rows=6, tf32=False)


def test_an_input_that_is_another_object_is_not_checked_here():
    class Cache(dict):
        """Stands for a KV cache, which a member's call would extend under the wide forward."""

    touched = []

    class Reads(nn.Module):
        def forward(self, x, cache):
            touched.append(cache)
            return x

    assert not agrees_here([Reads(), Reads()], (torch.randn(4, 2), Cache()), {}, torch.randn(4, 2), rows=4, tf32=False)
    assert not touched


def test_a_member_that_writes_into_its_input_leaves_the_wide_forwards_alone():
    class Doubles(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    x = torch.randn(4, 2)
    before = x.clone()
    assert agrees_here([Doubles(), Doubles()], (x,), {}, 2 * x, rows=4, tf32=False)
    assert torch.equal(x, before)


def test_a_member_that_raises_disagrees():
    class Raises(nn.Module):
        def forward(self, x):
            raise RuntimeError("no")

    assert not agrees_here([Raises(), Raises()], (torch.randn(4, 2),), {}, torch.randn(4, 2), rows=4, tf32=False)


@pytest.mark.parametrize("case", ["deberta-v2-seqcls"])
def test_a_block_that_takes_a_table_per_member_is_recorded_as_before(case):
    members = [CASES[case].build(seed) for seed in range(2)]
    wide = WideModel.from_models(members, verify=False)
    blocks = [e.fqn for e in wide.plan.by_kind(Kind.BLOCK) if e.wide_class.startswith("WideDeberta")]
    here = checked_here(wide, [e.fqn for e in wide.plan.entries.values()], members)
    assert blocks and not set(blocks) & here.keys()
    assert here  # its projections and norms are checked here
