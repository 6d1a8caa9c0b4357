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


def assert_gradients_are_the_members(wide, members, inputs, names=None) -> None:
    """Each member's gradients read off the wide model's (for a cotangent of its own) equal the member's own, for
    every parameter it trains (or those in ``names``)."""
    out = main_output(wide(**inputs))
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
    out.backward(cotangent)
    for i, member in enumerate(members):
        main_output(member(**inputs)).backward(cotangent[i])
        got = member_gradients(wide, i)
        want = {name: p.grad for name, p in member.named_parameters()
                if p.grad is not None and (names is None or name in names)}
        assert want and got.keys() >= want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, name=name: f"member {i}'s {name}: {m}")


def zero_dropout(model):
    """No dropout, in training mode too (transformers' configs leave some as floats that their modules read), so that
    gradients in training mode can be held to the members'."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        module.__dict__.update({k: 0.0 for k, v in vars(module).items() if "dropout" in k and isinstance(v, float)})
    return model
