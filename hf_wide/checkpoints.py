"""Building a wide model from checkpoint files without holding N models.

Loading (fused repos in :mod:`hf_wide.saving`, member checkpoints in :mod:`hf_wide.loading`) never materialises
N models: N *skeletons* (the members' modules with parameters on the meta device) go through the ordinary swap
walk, the resulting wide model is given uninitialised storage, and each member's tensors are read from the
safetensors files straight into their slots of the stacked parameters, one tensor at a time. The files are read with
``readinto`` rather than through a memory map: pages of a mapped file count towards the process's resident
memory until it is unmapped, which would double the peak.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from .fold import Fold
from .plan import WidePlan
from .planner import tensor_aliases
from .primitives import PerMemberFallback, VectorisedFallback, WideModule
from .swap import build_wide, member_copy

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# ---------------------------------------------------------------- reading safetensors without mapping them
def _layout_problem(header: dict, size: int) -> str | None:
    """What in a safetensors ``header`` does not describe its ``size`` bytes of data as the format requires (and the
    safetensors library, which transformers reads with, refuses): each tensor's bytes its shape times its dtype's
    size, the tensors laid end to end from byte 0 to the end. None where it does."""
    spans = []
    try:
        for key, entry in header.items():
            begin, end = (int(offset) for offset in entry["data_offsets"])
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])  # (one hf-wide does not read is refused when read)
            if dtype is not None and end - begin != math.prod(entry["shape"]) * dtype.itemsize:
                return f"{key!r}, {entry['dtype']} of shape {entry['shape']}, spans {end - begin} bytes"
            spans.append((begin, end, key))
    except (KeyError, TypeError, ValueError) as exc:
        return f"a tensor's entry in its header is malformed: {exc!r}"
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position or end < begin:
            return f"{key!r} spans bytes {begin} to {end} of its data, where the tensor before it ends at {position}"
        position = end
    if position != size:
        return f"its tensors' data ends at byte {position}, and it holds {size}"
    return None


class Checkpoint:
    """The tensors of one checkpoint folder (``model.safetensors`` or shards with an index), read on demand.

    The safetensors format is 8 bytes of header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
    and the raw little-endian data; only headers are read until :meth:`read_into` is called.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / WEIGHTS_INDEX_NAME
        if (folder / WEIGHTS_NAME).exists():  # first, as transformers reads it (an index beside it is stale: a
            files = [WEIGHTS_NAME]           # repo sharded once and uploaded whole since, uploads deleting nothing)
        elif index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            raise FileNotFoundError(f"No {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {folder}.")
        self.entries: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, start of its data, header entry)
        self._handles: dict[Path, object] = {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"{index} names the shard {name}, which is not in {folder}.")
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                try:
                    header = json.loads(f.read(header_len))
                except (ValueError, MemoryError, OverflowError) as exc:  # cut short, or not safetensors at all
                    raise OSError(f"{path} is no safetensors file that can be read (its header: {exc}); if it was "
                                  "downloaded, force_download=True fetches it again.") from None
            header.pop("__metadata__", None)
            problem = _layout_problem(header, path.stat().st_size - 8 - header_len)
            if problem is not None:  # (each tensor after it would be read from another's bytes, silently)
                raise OSError(f"{path} is no safetensors file that can be read ({problem}); if it was downloaded, "
                              "force_download=True fetches it again.")
            self.entries.update({key: (path, 8 + header_len, entry) for key, entry in header.items()})

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key][2]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        name = self.entries[key][2]["dtype"]
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"Tensor {key!r} has safetensors dtype {name}, which hf-wide does not read.")
        return SAFETENSORS_DTYPES[name]

    def _span(self, key: str, index: int | None) -> tuple[Path, int, int, tuple[int, ...]]:
        """(file, offset, length in bytes, shape) of a tensor, or of its slice [index] along dim 0."""
        path, data_start, entry = self.entries[key]
        begin, end = entry["data_offsets"]
        shape = self.shape(key)
        if index is not None:
            step = (end - begin) // shape[0]
            begin, end, shape = begin + index * step, begin + (index + 1) * step, shape[1:]
        return path, data_start + begin, end - begin, shape

    def _read(self, path: Path, offset: int, out: memoryview) -> None:
        f = self._handles.get(path)
        if f is None:
            f = self._handles[path] = open(path, "rb", buffering=0)  # unbuffered: readinto lands in `out` itself
        f.seek(offset)
        while out.nbytes:
            n = f.readinto(out)
            if not n:
                raise EOFError(f"{path} ends before tensor data at {offset}: the file is truncated.")
            out = out[n:]

    def read_into(self, key: str, dst: torch.Tensor, index: int | None = None) -> None:
        """Write tensor ``key`` (or its slice [index]) into ``dst``: straight into dst's memory when the dtype
        matches and dst is a contiguous CPU tensor, else through one temporary tensor."""
        path, offset, length, shape = self._span(key, index)
        if tuple(dst.shape) != shape:
            raise ValueError(f"{key}: the file holds shape {shape}, the model expects {tuple(dst.shape)}.")
        dtype = self.dtype(key)
        direct = dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous()
        target = dst.detach() if direct else torch.empty(shape, dtype=dtype)
        if length:
            self._read(path, offset, memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        if not direct:
            dst.detach().copy_(target)

    def chunks(self, key: str, size: int = 1 << 24):
        """The raw bytes of tensor ``key``, ``size`` at a time."""
        path, offset, length, _ = self._span(key, None)
        for start in range(0, length, size):
            buf = bytearray(min(size, length - start))
            self._read(path, offset + start, memoryview(buf))
            yield buf

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def same_bytes(checkpoints: Sequence[Checkpoint], keys: Sequence[str]) -> bool:
    """Whether ``checkpoints[j]`` holds the same tensor under ``keys[j]`` for every j: same dtype, shape and bytes.
    Compared in chunks, stopping at the first difference (the first chunk, for tensors that were trained)."""
    first, key0 = checkpoints[0], keys[0]
    for ckpt, key in zip(checkpoints[1:], keys[1:]):
        if ckpt.dtype(key) != first.dtype(key0) or ckpt.shape(key) != first.shape(key0):
            return False
        if any(a != b for a, b in zip(first.chunks(key0), ckpt.chunks(key))):
            return False
    return True


# ---------------------------------------------------------------- skeletons and filling
def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model``'s state dict, each once (tied weights under their first name)."""
    keys = set(model.state_dict(keep_vars=True))
    found, seen = {}, set()
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        if name in keys and id(t) not in seen:
            seen.add(id(t))
            found[name] = t
    return found


def empty_model(model_class: type, config, dtype: torch.dtype | None, **model_kwargs) -> nn.Module:
    """A transformers model built from ``config`` with its parameters on the meta device and its buffers real
    (rotary frequencies and position ids computed as usual), ties made, in eval mode. ``model_kwargs``
    (``attn_implementation``) go to transformers' ``_from_config``."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class._from_config(copy.deepcopy(config), dtype=dtype, **model_kwargs)
    model.tie_weights()  # accelerate's meta parameters break the ties made inside its context
    if dtype is not None:
        keep_in_float32_(model, dtype)
    return model.eval()


def keep_in_float32_(model: nn.Module, dtype: torch.dtype) -> None:
    """The tensors that transformers' ``from_pretrained`` keeps in float32 when it loads ``model`` in ``dtype``
    (``_keep_in_fp32_modules`` in float16, ``_keep_in_fp32_modules_strict`` in bfloat16 too: T5's ``wo``) made float32
    here as well, as its ``_from_config`` does not: a fused repo of half-precision T5s computed ``wo`` in half
    precision, 3e-3 off each member. Ties are kept."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    kept = re.compile("|".join(f"(?:{pattern.replace('*', '.*')})" for pattern in plan))  # searched, as transformers
    done: dict[int, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if not (kept.search(name) and tensor.is_floating_point() and tensor.dtype != torch.float32):
            continue
        if id(tensor) not in done:
            wider = tensor.detach().to(torch.float32)
            done[id(tensor)] = nn.Parameter(wider, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else wider
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        table = module._parameters if leaf in module._parameters else module._buffers
        table[leaf] = done[id(tensor)]


def skeleton_like(template: nn.Module, config=None, generation_config=None) -> nn.Module:
    """A copy of ``template`` whose state-dict tensors are on the meta device (ties kept; non-persistent buffers,
    which the checkpoint does not hold, copied as they are), with ``config`` and ``generation_config`` in place
    of the template's."""
    memo = {id(t): nn.Parameter(t.to("meta"), t.requires_grad) if isinstance(t, nn.Parameter) else t.to("meta")
            for t in state_tensors(template).values()}
    if config is not None:
        memo[id(template.config)] = config
    if generation_config is not None and getattr(template, "generation_config", None) is not None:
        memo[id(template.generation_config)] = generation_config
    return copy.deepcopy(template, memo)


def materialize_(model: nn.Module, device: torch.device) -> int:
    """Give every meta tensor of ``model`` uninitialised storage on ``device`` (ties kept), then let wide
    primitives recompute the helper buffers they derive in ``setup`` (embedding offsets). Returns the number of
    elements of the state dict's new tensors: what the checkpoints must fill."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    empty = torch.empty_like(t, device=device)
                    done[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                store[name] = done[id(t)]
    for module in model.modules():
        if isinstance(module, WideModule):
            module.setup(module.proto)
    left = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"hf-wide could not give storage to {left[:3]}: they stayed on the meta device.")
    created = {id(t) for t in done.values()}
    state = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() for key, t in state.items() if key in created)


class HeldOnce(ValueError):
    """A plan keeps one tensor for several members whose checkpoints hold it apart (:func:`fill_`'s ``alike``)."""


@torch.no_grad()
def fill_(model: nn.Module, aliases: dict[str, list[str]], num_members: int,
          read: Callable[[int, str, torch.Tensor], None], alike: Callable[[str], bool] | None = None) -> int:
    """Fill a materialised wide model member by member: ``read(i, name, dst)`` writes member i's tensor ``name``
    into ``dst``, a view into the wide model's storage (``member(i, share=True)`` gives those views). A tensor
    that all members share (a shared module's) is read once, from member 0: ``alike(name)``, where given, says
    whether every member's checkpoint holds the same tensor ``name``, and :class:`HeldOnce` is raised for one that
    is read once and does not. Returns the number of elements written."""
    done: dict[tuple, tuple[torch.Tensor, int]] = {}  # by place in storage: two views of one tied tensor read once
    fallbacks = [(path, m) for path, m in model.named_modules() if isinstance(m, (PerMemberFallback, VectorisedFallback))]
    for i in range(num_members):
        view = member_copy(model, i, aliases, share=True)
        tensors = list(state_tensors(view).items())
        # A fallback's tensor tied to one outside it (T5's encoder embeddings and the model's shared table) is not
        # reached through the member's view, whose ties lead outside: its own view is read as well, once where
        # it is the same place (tied again, hf_wide.swap.retie), or as the copy it is (a frozen one, held per
        # member beside a stacked one)
        reached = {name for name, _ in tensors}
        tensors += [(full, t) for path, fallback in fallbacks
                    for name, t in state_tensors(fallback.to_module(i, share=True)).items()
                    if (full := f"{path}.{name}" if path else name) not in reached]
        for name, t in tensors:
            place = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if place not in done:
                done[place] = t, i
                read(i, name, t)
            elif alike is not None and done[place][1] != i and not alike(name):
                raise HeldOnce(f"the plan holds {name} once for members {done[place][1]} and {i}, whose checkpoints "
                               "hold it apart")
    return sum(t.numel() for t, _ in done.values())


def assemble(skeletons: Sequence[nn.Module], plan: WidePlan, device, read,
             alike: Callable[[str], bool] | None = None) -> tuple[nn.Module, Fold, dict]:
    """The wide model of ``skeletons`` under ``plan``, with its storage on ``device`` and filled by ``read``
    (``alike``: see :func:`fill_`). Returns the folded model, its fold and the template's tensor aliases."""
    fold = Fold(len(skeletons))
    model = build_wide(skeletons, plan, fold)
    empty = materialize_(model, torch.device(device or "cpu"))
    aliases = tensor_aliases(skeletons[0])
    filled = fill_(model, aliases, len(skeletons), read, alike)
    if filled != empty:  # every element the members' views reach, and nothing else, must be written once
        raise RuntimeError(f"hf-wide filled {filled} of the {empty} elements of the wide model's new tensors.")
    return model.to(device) if device is not None else model, fold, aliases
