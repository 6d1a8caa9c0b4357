"""LoRA members for tests: one base, an adapter of its own per member with random A and B (PEFT starts B at zero,
which would leave nothing to test)."""

import copy
import json
from pathlib import Path

import peft
import torch
from conftest import CASES

LLAMA = CASES["llama-causallm"]
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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


def save_adapter(case, base_dir, folder, seed: int, base_name: str | None = None, **config):
    """An adapter of the base saved at ``base_dir``, with random A and B, saved to ``folder``: the same for the same
    ``seed`` whatever ran before (PEFT draws its A from the global generator)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = peft.get_peft_model(case.model_class.from_pretrained(base_dir), peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    trains_biases = config.get("bias", "none") != "none"  # PEFT's bias="all" or "lora_only": saved with the adapter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name or (trains_biases and "bias" in name and p.requires_grad):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    if base_name is not None:  # where the base lives on the Hub
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "base_model_name_or_path": base_name}))
    return str(folder)


def alone(case, base_dir, adapter) -> peft.PeftModel:
    return peft.PeftModel.from_pretrained(case.model_class.from_pretrained(base_dir), adapter).eval()


def lora_keys(model) -> set[str]:
    return {k for k in model.state_dict() if "lora_" in k}


def save_llama_adapters(root: Path) -> tuple[Path, list[str]]:
    """A Llama base and three adapters of it under ``root``: ranks 4, 8 and 16 on different targets, one with
    rsLoRA."""
    LLAMA.build(0).save_pretrained(root / "base")
    adapters = [
        save_adapter(LLAMA, root / "base", root / "a0", 0, r=4, lora_alpha=8, target_modules=EVERY_LINEAR,
                     task_type="CAUSAL_LM"),
        save_adapter(LLAMA, root / "base", root / "a1", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                     task_type="CAUSAL_LM"),
        save_adapter(LLAMA, root / "base", root / "a2", 2, r=16, lora_alpha=8, use_rslora=True,
                     target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"], task_type="CAUSAL_LM"),
    ]
    return root / "base", adapters
