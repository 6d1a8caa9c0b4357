"""Views of the one base that adapter members load over (:mod:`hf_wide.adapters`): structural copies that hold the
base's own tensors (:func:`shared_view`, :func:`adapter_view`), the base tensors an adapter's file holds values of
held once again (:func:`held_base_tensors`, :func:`reshare`), and the refusal of an adapter that writes into the
base as it loads (:func:`base_untouched`): every member would then compute with what it wrote.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from .compat import IncompatibleMembersError
from .primitives.base import same_value


def shared_view(model: nn.Module, own: Callable[[str], bool] | None = None,
                memo: dict[int, object] | None = None) -> nn.Module:
    """A structural copy of ``model`` that holds the very same tensors (nothing is copied), except those whose
    names ``own`` picks: copies of its own (a tensor tied under several names is copied where ``own`` picks any of
    them, and stays tied). ``memo`` (filled in): the ``copy.deepcopy`` memo, each copied tensor's copy by ``id``."""
    tensors = _named_tensors(model)
    copied = set() if own is None else {id(t) for name, t in tensors if own(name)}
    memo = {} if memo is None else memo
    memo.update({id(t): t for name, t in tensors if id(t) not in copied})
    return copy.deepcopy(model, memo)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` under each of its names (tied ones under every name)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def held_base_tensors(keys: Iterable[str], base: nn.Module) -> set[str]:
    """The names in ``base`` of its own tensors whose values an adapter file holds (``keys``, the file's names, as
    PEFT writes them): the base layers of the embeddings a LoRA adapts, which PEFT saves whole
    (``save_embedding_layers``), as ``...embed_tokens.base_layer.weight``. Not the modules it saves whole
    (``modules_to_save``): those load into copies of their own, and their names (``classifier.weight``) say nothing
    of it; a file that does write into the base is refused as it loads (:func:`base_untouched`)."""
    names = {name for name, _ in _named_tensors(base)}
    layers = (key.removeprefix("base_model.model.").replace(".base_layer.", ".") for key in keys
              if ".base_layer." in key)
    return {name for name in layers if name in names}


def adapter_view(base: nn.Module, config: dict, held: set[str] = frozenset()
                 ) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The base for one adapter to load over: a :func:`shared_view`, with copies of its own of the base tensors
    the adapter holds values of. PEFT's ``bias="all"`` trains and saves every tensor whose name holds "bias", and
    ``bias="lora_only"`` the biases of the layers it adapts: loaded into the shared tensors, one adapter's biases
    would be every member's. ``held`` (:func:`held_base_tensors`): the other base tensors its file holds, each
    copied too, and returned by name as (the base's, the copy) for :func:`reshare` once the adapter has loaded."""
    trains_biases = config.get("bias", "none") != "none"
    held = {name for name in held if not (trains_biases and "bias" in name)}  # trained: each member's own
    memo: dict[int, object] = {}
    view = shared_view(base, lambda name: name in held or (trains_biases and "bias" in name), memo)
    tensors = dict(_named_tensors(base))
    return view, {name: (tensors[name], memo[id(tensors[name])]) for name in sorted(held)}


def reshare(view: nn.Module, copies: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str) -> None:
    """Once an adapter has loaded over ``view`` (:func:`adapter_view`): each base tensor its file held values of
    becomes the base's own again where the values are the base's (PEFT saves an embedding layer it adapts whole,
    unchanged unless the vocabulary grew), held once; the adapter is refused where they differ."""
    differ = [key for key, (ours, loaded) in copies.items() if not same_value(ours, loaded)]
    if differ:
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise IncompatibleMembersError(
            f"{name} holds values of the base's own tensors ({shown}) that differ from the base's, which its members "
            "share. Pass merge=True to merge each adapter into its own copy of the base (each checked against its "
            "adapter unmerged; N full weight sets).")
    base_of_copy = {id(loaded): ours for ours, loaded in copies.values()}
    for module in view.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and id(t) in base_of_copy:
                    table[key] = base_of_copy[id(t)]


@contextlib.contextmanager
def base_untouched(base: nn.Module, name: str) -> Iterator[None]:
    """Refuse an adapter that, as it loads, writes into a tensor of the base its members share (one the
    adapter's file was not seen to hold, see :func:`held_base_tensors`), in place or by giving it new data
    (``weight.data = ...``, which PEFT's PiSSA does and no version counter sees): it would change every member, so no
    member would be what was saved."""
    tensors = base.state_dict(keep_vars=True)
    before = {key: _written(t) for key, t in tensors.items()}
    # Loading a state dict without BatchNorm's num_batches_tracked copies the module's own count into it: written,
    # by its version, with its own value. One-element tensors are compared by value too.
    scalars = {key: t.detach().clone() for key, t in tensors.items() if t.numel() == 1}
    yield
    written = [key for key, t in base.state_dict(keep_vars=True).items() if _written(t) != before[key] and not (
        key in scalars and _written(t)[1:] == before[key][1:] and torch.equal(t.detach(), scalars[key]))]
    if written:
        shown = ", ".join(written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")
        raise IncompatibleMembersError(
            f"{name} writes into the base's own tensors as it loads ({shown}), which its members share. Pass "
            "merge=True to merge each adapter into its own copy of the base (each checked against its adapter "
            "unmerged; N full weight sets).")


def _written(t: torch.Tensor) -> tuple:
    """What changes when ``t`` is written: its version (in place) and its data (``t.data = ...``)."""
    return _version(t), t.data_ptr(), t.shape, t.dtype, t.device


def _version(t: torch.Tensor) -> int | None:
    """How many times ``t`` was written in place (None for inference tensors, which do not count)."""
    try:
        return t._version
    except RuntimeError:
        return None
