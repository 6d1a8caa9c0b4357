"""hf_wide/compare.py: a wide output against its members' outputs, in each layout a wide module may give."""

import torch

from hf_wide.compare import UNCHECKED, compare_outputs, member_error, tolerance


def members(n=3, batch=2):
    torch.manual_seed(0)
    return [torch.randn(batch, 4) for _ in range(n)]


def test_each_layout_holds_its_members():
    refs = members()
    assert member_error(torch.cat(refs), refs, rows=6) == 0.0  # (N*B, ...): the folded rows
    assert member_error(torch.stack(refs), refs, rows=6) == 0.0  # (N, ...): one per member
    same = [refs[0]] * 3
    assert member_error(refs[0], same, rows=6) == 0.0  # the member's very shape: the same for all


def test_a_member_off_by_more_than_its_tolerance_fails_and_names_the_output():
    refs = members()
    out = torch.cat(refs)
    out[4, 0] += 3 * tolerance(refs[2])  # member 2's rows
    assert member_error(out, refs, rows=6) > 1
    assert "output 0: 3x the tolerance" in compare_outputs((out,), [(r,) for r in refs], rows=6)


def test_unchecked_members_are_left_out_but_keep_their_rows():
    refs = members()
    out = torch.cat(refs)
    out[4, 0] += 1.0  # member 2's rows are wrong
    assert compare_outputs(out, [refs[0], refs[1], UNCHECKED], rows=6) is None
    assert compare_outputs(out, [UNCHECKED, UNCHECKED, refs[2]], rows=6) is not None
    assert compare_outputs(out, [UNCHECKED, refs[1], UNCHECKED], rows=6) is None  # the rows are still member 1's


def test_outputs_of_another_structure_disagree():
    refs = members()
    assert "another structure" in compare_outputs((torch.cat(refs),), [(r, r) for r in refs], rows=6)
