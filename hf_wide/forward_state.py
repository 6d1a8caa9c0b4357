"""What a forward may change in a model besides its outputs, noted before fusion runs the members (and the wide model)
on the sample, and put back after: fusion leaves the members as they were given, and builds the wide model from them
as given.

- Buffers a forward updates (a call counter; a statistic some code keeps even in eval mode): a count came back raised
  by the fusion's forwards, and the wide model was built with it.
- Plain attributes a forward sets on the model's own modules (not hf-wide's): BigBird switches itself to full
  attention for good on a sequence shorter than its block-sparse minimum (the built sample's 8 tokens), and Swin sets
  a layer's shift to 0 for good on an image no bigger than its window. Left so, the wide model (and the members given)
  ran full attention on 400 tokens where block-sparse checkpoints run block-sparse (4.9e-3 off; BigBirdPegasus 0.85),
  and Swin without the shift at 64x64 (6.9e-3 off).
- Submodules a forward swaps for others (BigBird's attention, for block-sparse or full attention) are put back on
  the members, and refused by :meth:`StateSnapshot.swapped_module`'s caller: the plan was traced through the modules
  the sample's forward made, which are not the checkpoint's.
- Parameters are not copied (that would double the members' memory): a forward that changes one in place (RWKV
  rescales its layers' weights in eval mode) is refused by :meth:`StateSnapshot.changed_parameter`'s caller, since
  ``member(i)``, a saved repo and training would hold the changed weights (0.26-0.42 off the originals).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

SCALARS = (str, int, float, bool, type(None))  # plain attributes a forward may set (``attention_type``, ``shift_size``)


class StateSnapshot:
    """The buffers of ``modules``, the plain scalar attributes of their own submodules (hf-wide's are left alone: what
    verification learns lives there), their children and (``parameters``) their parameters' versions and norms, as
    they are now; :meth:`restore` puts the buffers, attributes and children back."""

    def __init__(self, modules: Sequence[nn.Module], parameters: bool = True):
        seen = set()
        self.buffers = []  # (module, name, the buffer, a copy of its value)
        self.attributes = []  # (module, name, value)
        self.versions = []  # (index of the model, name, parameter, its version, its norm)
        self.children = []  # (index of the model, path, module, its children)
        for index, model in enumerate(modules):
            for path, module in model.named_modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        self.buffers.append((module, name, buffer, buffer.detach().clone()))
                if not type(module).__module__.startswith("hf_wide."):
                    self.attributes += [(module, k, v) for k, v in vars(module).items()
                                        if not k.startswith("_") and k != "training" and isinstance(v, SCALARS)]
                    self.children.append((index, path, module, dict(module._modules)))
            if parameters:  # (a norm per parameter: only where :meth:`changed_parameter` will be asked)
                self.versions += [(index, name, p, p._version, _norm(p)) for name, p in model.named_parameters()]

    @torch.no_grad()
    def restore(self) -> None:
        for module, name, buffer, value in self.buffers:
            if buffer.shape != value.shape:  # resized in place
                module._buffers[name] = value.clone()  # (the snapshot's own stays as it was, for the next restore)
                continue
            if not torch.equal(buffer, value):
                buffer.copy_(value)
            module._buffers[name] = buffer  # (a forward may rebind it: ``self.calls = self.calls + 1``)
        for module, name, value in self.attributes:
            attrs = vars(module)
            if attrs.get(name, value) is not value:
                attrs[name] = value
        for _, _, module, children in self.children:
            if module._modules != children:
                module._modules.clear()
                module._modules.update(children)

    def swapped_module(self) -> tuple[int, str, str, str] | None:
        """(the model's index, the path, the class before, the class now) of the first submodule swapped for another
        since the snapshot."""
        for index, path, module, children in self.children:
            for name, child in module._modules.items():
                if children.get(name, child) is not child:
                    where = f"{path}.{name}" if path else name
                    return index, where, type(children[name]).__name__, type(child).__name__
        return None

    def changed_parameter(self) -> tuple[int, str] | None:
        """(the model's index, the parameter's name) of the first parameter changed in place since the snapshot: written
        to (its version moved on) and no longer of its norm. (PEFT's LoRA on a parameter, a router's weight, adds its
        update in place for the forward and takes it off again: written, but as it was, to the last bits.)"""
        return next(((index, name) for index, name, p, version, norm in self.versions
                     if p._version != version and abs(_norm(p) - norm) > 1e-3 * norm), None)


def _norm(p: torch.Tensor) -> float:
    """The tensor's norm in its own dtype (another would copy it whole: twice a float32 tensor's memory in float64).
    A change a thousandth of it or more counts (RWKV halves its weights); its last bits do not."""
    return float(torch.linalg.vector_norm(p.detach())) if p.numel() and p.is_floating_point() else 0.0


def refuse_changes(given: StateSnapshot, ids: Sequence[str]) -> None:
    """Refuse members whose forward on the sample swapped a submodule for another, or changed a parameter in place
    (see :mod:`hf_wide.forward_state`)."""
    swapped = given.swapped_module()
    if swapped is not None:
        index, path, before, now = swapped
        raise _refusal(
            f"{ids[index]}: its forward on the sample swapped its module {path!r} ({before}) for a {now} (BigBird "
            "switches to full attention on sequences shorter than its block-sparse minimum), so the plan would be "
            "traced through other modules than the checkpoint's. Fuse on a sample that keeps its modules (from_models("
            "..., sample_inputs=...)), or load it in the mode the sample takes (BigBird: "
            "attention_type='original_full').")
    changed = given.changed_parameter()
    if changed is not None:
        raise _refusal(
            f"{ids[changed[0]]}: its forward changes its parameter {changed[1]!r} in place (as RWKV rescales its "
            "layers' weights in eval mode), so the wide model, member(i), a saved repo and training would hold other "
            "weights than the checkpoint's. Turn that off in its config (RWKV: rescale_every=0) and fuse again.")


def _refusal(message: str) -> Exception:
    from .model import WideValidationError

    return WideValidationError(message)
