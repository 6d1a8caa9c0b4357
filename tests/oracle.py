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
