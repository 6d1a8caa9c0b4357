"""hf_wide/compare.py: a wide output against its members' outputs, in each layout a wide module may give."""

import dataclasses

import pytest
import torch
from torch import nn

from hf_wide.compare import TF32_REL, UNCHECKED, compare_outputs, member_error, tf32_possible, tolerance


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


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


def test_a_dataclass_output_is_named_as_what_hf_wide_cannot_see_into():
    """A plain dataclass is one leaf to torch's pytree: it was refused as "a layout that matches no member's"."""
    refs = members()
    message = compare_outputs(Output(torch.cat(refs)), [Output(r) for r in refs], rows=6)
    assert "a dataclass (Output)" in message and "ModelOutput" in message
    meta = Output("cls")  # one that holds no tensor, alike in every member, passes as any such output
    assert compare_outputs((torch.cat(refs), meta), [(r, meta) for r in refs], rows=6) is None


@pytest.fixture
def torch_defaults():
    """cuDNN's TF32 on, matmuls' off: torch's defaults, put back after."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_tf32_is_possible_where_cudnn_or_matmuls_may_round_to_it(torch_defaults):
    convolutional, linear = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    assert tf32_possible(convolutional) and tf32_possible(nn.LSTM(2, 2)) and not tf32_possible(linear)
    torch.backends.cuda.matmul.allow_tf32 = True  # set_float32_matmul_precision("high")
    assert tf32_possible(linear)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    assert not tf32_possible(convolutional)


def test_tf32_widens_the_tolerance_of_float32_on_cuda_only():
    reference = torch.full((3,), 2.0)
    assert tolerance(reference, tf32=True) == tolerance(reference) == 2e-4  # on the CPU float32 is float32
    assert tolerance(reference.half(), tf32=True) == tolerance(reference.half())
    if torch.cuda.is_available():
        assert tolerance(reference.cuda(), tf32=True) == 2 * TF32_REL > tolerance(reference.cuda())
