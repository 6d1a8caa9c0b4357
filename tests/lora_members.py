"""LoRA members for tests: one base, an adapter of its own per member with random A and B (PEFT starts B at zero,
which would leave nothing to test)."""

import copy

import peft
import torch


def adapted(base, seed: int, scale: float = 0.1, **config) -> peft.PeftModel:
    """``base`` (copied) with a LoRA adapter (``peft.LoraConfig(**config)``) whose A and B are random from ``seed``."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def own_biases(members, seed: int, scale: float = 0.1) -> None:
    """Give each member's adapted layers biases of their own (PEFT's ``bias="lora_only"`` trains them), random
    from ``seed``; the base weights stay equal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for member in members:
            for name, p in member.named_parameters():
                if name.endswith("base_layer.bias"):
                    p.add_(scale * torch.randn(p.shape, generator=gen))


def check_own_dropouts(wide, members, inputs, tolerance: float) -> None:
    """Members with ``lora_dropout`` 0 and 1: in training, member 0's update stays whole (its output is its
    output in eval) and member 1's is all dropped (its output is the base's): each member's own dropout."""
    with torch.no_grad():
        evaluated = [member(**inputs).logits for member in members]
        for model in (wide, *members):
            model.train()
        got = wide(**inputs).logits
        with members[1].disable_adapter():
            base = members[1](**inputs).logits
    assert (got[0] - evaluated[0]).abs().max().item() <= tolerance
    assert (got[1] - base).abs().max().item() <= tolerance
    assert (evaluated[1] - base).abs().max().item() > 1e-3  # the update had mattered
