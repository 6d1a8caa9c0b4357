"""What a list of PEFT adapters must be for hf-wide to fuse them as LoRA members, checked before anything loads:
each adapter's weights and config (:func:`check_adapter_weights`, :func:`lora_refusal`), and what the list must
share (:func:`check_layer_replication`)."""

from __future__ import annotations

from pathlib import Path

from .compat import IncompatibleMembersError


# PEFT's initialisations that change the base layer's weight, and do again each time such an adapter loads (the
# base's weight less the adapter's first update): the adapter is exact only over a base of its own.
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq")


def lora_refusal(config: dict) -> str | None:
    """Why an adapter config cannot be fused as LoRA (None if it can): its PEFT type, a LoRA variant, or an
    initialisation that changes the base as it loads."""
    if config.get("peft_type") != "LORA":
        return f"is a {config.get('peft_type')} adapter; hf-wide fuses LoRA adapters"
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        return (f"uses init_lora_weights={init!r}, which changes the base's weights as the adapter loads, where its "
                "members share one base (PEFT can convert such an adapter into an ordinary LoRA one: "
                "path_initial_model_for_weight_conversion in save_pretrained)")
    if config.get("use_bdlora"):  # (fan_in_fan_out, GPT-2's Conv1D: taken, blocks/lora.py)
        return f"uses use_bdlora={config['use_bdlora']!r}, which hf-wide does not fuse"
    if config.get("lora_bias"):  # merge=True, offered next, then fails on a layer without a bias: said beforehand
        return ("uses lora_bias=True, which hf-wide does not fuse (merged, it needs every adapted layer of the base "
                "to have a bias of its own: PEFT cannot merge it otherwise)")
    # (MiCA, init_lora_weights="mica", is LoRA's forward with B frozen: fused as LoRA)
    for option in ("alora_invocation_tokens", "arrow_config", "velora_config", "monteclora_config", "kasa_config"):
        if config.get(option) not in (None, False):
            return f"uses {option}, a LoRA variant hf-wide does not fuse"
    return None


def check_layer_replication(replications: list, names: list[str]) -> None:
    """Refuse members that replicate the base's layers (``layer_replication``) in different ways, or beside members
    that do not (the base, a full checkpoint): each pattern is a model of another depth, whose layers share tensors
    in its own way. ``replications``: each member's pattern (None: none)."""
    first = replications[0]
    for name, replication in zip(names[1:], replications[1:]):
        if replication != first:
            raise IncompatibleMembersError(
                f"The members replicate the base's layers (layer_replication) differently: {names[0]} {first or 'not'}"
                f", {name} {replication or 'not'}. hf-wide fuses members that replicate layers only when every member "
                "replicates them the same way: fuse each pattern's adapters apart.")


def check_adapter_weights(folder: Path, name: str, allow_pickle: bool) -> None:
    if (folder / "adapter_model.safetensors").is_file():
        return
    if (folder / "adapter_model.bin").is_file():
        if not allow_pickle:
            raise ValueError(f"{name} has only pickle weights (adapter_model.bin), which can run arbitrary code when "
                             "loaded. Pass allow_pickle=True if you trust it.")
        return
    raise FileNotFoundError(f"{name} has no adapter weights (adapter_model.safetensors) in {folder}.")
