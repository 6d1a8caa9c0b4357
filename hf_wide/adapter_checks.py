"""What a list of PEFT adapters must be for hf-wide to fuse them as LoRA members, checked before anything loads:
each adapter's weights and config (:func:`check_adapter_weights`, :func:`lora_refusal`), and what the list must
share (:func:`check_layer_replication`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

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


def mergeable(config: dict) -> bool:
    """Whether PEFT can merge an adapter of this config into its base (``merge_and_unload``): not prompt learning
    (prompt tuning, prefix tuning, ...) nor adaption prompts, whose tuners hold no update of the base's weights."""
    try:
        from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    except ImportError:  # (a PEFT that keeps it elsewhere: the merge is tried, and its error named by merged())
        return True
    tuner = PEFT_TYPE_TO_TUNER_MAPPING.get(config.get("peft_type"))
    return (tuner is not None and hasattr(tuner, "merge_and_unload")
            and config.get("peft_type") not in PER_INPUT)


# Adapters that mix their updates per input (a router reading task_ids, or the hidden states): no one merge of them
# is the adapter, though their tuners have PEFT's merge_and_unload
PER_INPUT = frozenset({"POLY", "XLORA"})


def merged(member: nn.Module, name: str) -> nn.Module:
    """``member`` (a ``PeftModel`` over its own copy of the base) merged into that copy, checked against itself
    unmerged on the sample the fusion checks with. PEFT's ``merge_and_unload`` writes each update into the tensor it
    adapts, and where that tensor is tied to another (the input embeddings and the output head of GPT-2, or of a Llama
    with tied embeddings), the other took the update too: the merged member was 34.8 off its PeftModel, and the
    fusion, checked against the merged members, said nothing."""
    from .compare import compare_outputs, first_line
    from .samples import sample_inputs, sample_kwargs

    member.eval()
    sample = sample_kwargs(member, sample_inputs(member))  # (no cache: a DynamicCache is no pytree to compare)
    try:
        with torch.no_grad():
            unmerged = member(**sample)
        model = member.merge_and_unload().eval()
    except Exception as exc:
        raise IncompatibleMembersError(f"{name} cannot be merged into its base: {first_line(exc, 300)}") from exc
    with torch.no_grad():
        why = compare_outputs(model(**sample), [unmerged], rows=next(
            v for v in sample.values() if isinstance(v, torch.Tensor)).shape[0])
    if why is not None:
        tied = " (its base ties its input and output embeddings)" if getattr(
            model.config, "tie_word_embeddings", False) else ""
        raise IncompatibleMembersError(
            f"{name} merged into its base is not the adapter{tied}: on the sample, the merged model "
            f"{why.replace('with its members', 'with the adapter unmerged')}. PEFT's "
            "merge writes each update into the tensor it adapts, and a tensor the base shares between two modules "
            "takes it for both. Load the adapter without merge=True where hf-wide fuses it as LoRA, or run it "
            "with PEFT alone.")
    return model


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
