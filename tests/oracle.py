"""The central oracle: member i of the wide model equals checkpoint i run alone."""

import torch

TOLERANCE = 1e-5  # float32, max abs difference


def main_output(output) -> torch.Tensor:
    """The tensor a user reads first: logits for heads, last_hidden_state for bare encoders."""
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output.last_hidden_state


@torch.no_grad()
def max_member_error(wide, members, inputs) -> float:
    """max over members of |wide member i - member i alone|, on the same inputs."""
    wide_out = main_output(wide(**inputs))
    assert wide_out.shape[0] == len(members)
    worst = 0.0
    for i, member in enumerate(members):
        alone = main_output(member(**inputs))
        assert wide_out[i].shape == alone.shape
        worst = max(worst, (wide_out[i] - alone).abs().max().item())
    return worst


def member_gradients(wide, i: int) -> dict[str, torch.Tensor]:
    """Member i's gradients by its parameters' names, read off the wide model's after a backward: member i taken out
    as views into the wide model's tensors (``member(i, share=True)``), each view's place in its tensor read in that
    tensor's gradient."""
    found = {}
    tensors = [p for p in wide.parameters() if p.grad is not None]
    for name, view in wide.member(i, share=True).named_parameters():
        owner = next((p for p in tensors if p.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()), None)
        if owner is not None:
            assert owner.grad.stride() == owner.stride(), f"{name}: its gradient is laid out apart from its tensor"
            offset = view.storage_offset() - owner.storage_offset() + owner.grad.storage_offset()
            found[name] = owner.grad.as_strided(view.shape, view.stride(), offset)
    return found
