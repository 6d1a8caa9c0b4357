"""Fused repos on disk, and building a wide model from checkpoint files without holding N models.

A fused repo is one folder (or Hub repo) that ``WideModel.from_pretrained`` loads back as it was:

    config.json          the base model config plus an ``hf_wide`` section (see :func:`wide_config_section`)
    model.safetensors    every member's state dict, stacked: ``bert.encoder.layer.0.attention.self.query.weight``
                         of shape (N, D, D) holds member i's tensor at [i]. A tensor identical in all members is
                         stored once, without the member dim, and listed in ``hf_wide.shared``. Above
                         ``max_shard_size``: ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``.
    generation_config.json, tokenizer / processor files, README.md (the model card, :mod:`hf_wide.card`)

Tensors are keyed by the members' own (transformers) names, not by our wide layout, so the file does not depend
on which blocks or primitives hf-wide has: the plan is stored beside it and reapplied as it was.

Loading, here for fused repos and in :mod:`hf_wide.hub` for member repos, never materialises N models: N
*skeletons* (the members' modules with parameters on the meta device) go through the ordinary swap walk, the
resulting wide model is given uninitialised storage, and each member's tensors are read from the safetensors
files straight into their slots of the stacked parameters, one tensor at a time. The files are read with
``readinto`` rather than through a memory map: pages of a mapped file count towards the process's resident
memory until it is unmapped, which would double the peak.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import warnings
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from .fold import Fold
from .plan import Kind, ModulePlan, WidePlan
from .planner import tensor_aliases
from .primitives import PerMemberFallback, VectorisedFallback, WideModule
from .swap import build_wide, member_copy

FORMAT_VERSION = 1
CONFIG_KEY = "hf_wide"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Tokenizer, processor and chat-template files: copied into a fused repo from the members' folders.
TOKENIZER_PATTERNS = ["tokenizer*.json", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.model", "*.tiktoken", "chat_template.*", "*preprocessor_config.json", "processor_config.json"]
# Config fields kept out of a fused repo's per-member overrides: where a checkpoint came from (not carried
# over), and the labels (stored in ``hf_wide.labels``).
NOT_OVERRIDDEN = {"_name_or_path", "_commit_hash", "transformers_version", "id2label", "label2id"}

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class FusedRepoError(ValueError):
    """A fused repo whose files do not agree with its ``hf_wide`` config section."""


# ---------------------------------------------------------------- reading safetensors without mapping them
class Checkpoint:
    """The tensors of one checkpoint folder (``model.safetensors`` or shards with an index), read on demand.

    The safetensors format is 8 bytes of header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
    and the raw little-endian data; only headers are read until :meth:`read_into` is called.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / WEIGHTS_INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / WEIGHTS_NAME).exists():
            files = [WEIGHTS_NAME]
        else:
            raise FileNotFoundError(f"No {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} in {folder}.")
        self.entries: dict[str, tuple[Path, int, dict]] = {}  # name -> (file, start of its data, header entry)
        self._handles: dict[Path, object] = {}
        for name in files:
            path = folder / name
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
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


def empty_model(model_class: type, config, dtype: torch.dtype | None) -> nn.Module:
    """A transformers model built from ``config`` with its parameters on the meta device and its buffers real
    (rotary frequencies and position ids computed as usual), ties made, in eval mode."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class._from_config(copy.deepcopy(config), dtype=dtype)
    model.tie_weights()  # accelerate's meta parameters break the ties made inside its context
    return model.eval()


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


@torch.no_grad()
def fill_(model: nn.Module, aliases: dict[str, list[str]], num_members: int,
          read: Callable[[int, str, torch.Tensor], None]) -> int:
    """Fill a materialised wide model member by member: ``read(i, name, dst)`` writes member i's tensor ``name``
    into ``dst``, a view into the wide model's storage (``member(i, share=True)`` gives those views). A tensor
    that all members share (a shared module's) is read once. Returns the number of elements written."""
    done: dict[int, torch.Tensor] = {}  # keeps the tensors alive, so their ids stay unique
    fallbacks = [(path, m) for path, m in model.named_modules() if isinstance(m, (PerMemberFallback, VectorisedFallback))]
    for i in range(num_members):
        view = member_copy(model, i, aliases, share=True)
        tensors = list(state_tensors(view).items())
        # A fallback's own copy of a tensor tied to one outside it (T5's encoder embeddings and the model's
        # shared table) is not reached through the member's view, whose ties lead outside: read it as well.
        reached = {name for name, _ in tensors}
        tensors += [(full, t) for path, fallback in fallbacks
                    for name, t in state_tensors(fallback.to_module(i, share=True)).items()
                    if (full := f"{path}.{name}" if path else name) not in reached]
        for name, t in tensors:
            if id(t) not in done:
                done[id(t)] = t
                read(i, name, t)
    return sum(t.numel() for t in done.values())


def assemble(skeletons: Sequence[nn.Module], plan: WidePlan, device, read) -> tuple[nn.Module, Fold, dict]:
    """The wide model of ``skeletons`` under ``plan``, with its storage on ``device`` and filled by ``read``.
    Returns the folded model, its fold and the template's tensor aliases."""
    fold = Fold(len(skeletons))
    model = build_wide(skeletons, plan, fold)
    empty = materialize_(model, torch.device(device or "cpu"))
    aliases = tensor_aliases(skeletons[0])
    filled = fill_(model, aliases, len(skeletons), read)
    if filled != empty:  # every element the members' views reach, and nothing else, must be written once
        raise RuntimeError(f"hf-wide filled {filled} of the {empty} elements of the wide model's new tensors.")
    return model.to(device) if device is not None else model, fold, aliases


# ---------------------------------------------------------------- the plan and config as data
def plan_to_dict(plan: WidePlan) -> dict:
    data = dataclasses.asdict(plan)
    for entry in data["entries"].values():
        entry["kind"] = Kind(entry["kind"]).value
    return data


def plan_from_dict(data: dict) -> WidePlan:
    entries = {fqn: ModulePlan(**{**e, "kind": Kind(e["kind"])}) for fqn, e in data["entries"].items()}
    return WidePlan(**{**data, "entries": entries})


def member_config(base, overrides: dict):
    """``base`` with a member's own fields (labels, provenance) set on a copy."""
    config = copy.deepcopy(base)
    for key, value in overrides.items():
        setattr(config, key, copy.deepcopy(value))
    return config


def config_overrides(config, base) -> dict:
    """The fields of ``config`` that differ from ``base``, leaving out labels and provenance."""
    a, b = config.to_dict(), base.to_dict()
    return {k: v for k, v in a.items() if k not in NOT_OVERRIDDEN and b.get(k) != v}


def wide_config_section(wide, shared: Sequence[str]) -> dict:
    """The ``hf_wide`` section of a fused repo's config.json."""
    configs = wide.member_configs or [wide.config] * wide.num_members
    return {
        "format_version": FORMAT_VERSION,
        "num_members": wide.num_members,
        "member_ids": list(wide.member_ids),
        "member_revisions": list(wide.member_revisions),
        "labels": [{str(k): v for k, v in (c.id2label or {}).items()} for c in configs],
        "member_config_overrides": [config_overrides(c, configs[0]) for c in configs],
        "shared": sorted(shared),
        "plan": plan_to_dict(dataclasses.replace(wide.plan, num_members=wide.num_members)),
    }


def read_section(folder: str | Path) -> dict | None:
    """The ``hf_wide`` section of ``folder/config.json``: a dict for a fused repo, else None."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return None
    section = json.loads(path.read_text()).get(CONFIG_KEY)
    if section is not None and section.get("format_version", 0) > FORMAT_VERSION:
        raise FusedRepoError(f"{folder} was saved by a newer hf-wide (format {section['format_version']}, this "
                             f"one reads up to {FORMAT_VERSION}): upgrade hf-wide.")
    return section


def model_class_for(config, name: str) -> type:
    """The transformers class a config names in ``architectures``."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    raise ValueError(
        f"{name}: config.architectures is {architectures!r}, which names no transformers class; "
        "load the models yourself and use WideModel.from_models."
    )


# ---------------------------------------------------------------- saving a fused repo
def save_wide(wide, save_directory: str | Path, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              tokenizer=None, processor=None, repo_id: str | None = None, overwrite_readme: bool = False) -> Path:
    """Write ``wide`` as one fused repo in ``save_directory`` (see the module docstring). An existing README.md
    there is kept unless ``overwrite_readme``. Returns the folder."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from .card import model_card

    if wide.config is None:
        raise TypeError("Only transformers models (with a config) can be saved as a fused repo; "
                        "save plain modules with torch.save(wide.state_dict()).")
    refuse_peft_without_sources(wide)
    if wide.members_group is not None and getattr(wide, "adapter_sources", None) is not None:
        raise NotImplementedError("Saving adapters loaded member-parallel is not supported: save the adapters "
                                  "themselves (each rank's PeftModel members), or load them in one process.")
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    if getattr(wide, "adapter_sources", None) is not None:  # adapters of one base: the base referenced
        from .adapter_repos import save_adapter_ensemble

        section = {k: v for k, v in wide_config_section(wide, []).items() if k in (
            "format_version", "num_members", "member_ids", "member_revisions")}
        save_adapter_ensemble(wide, directory, section, repo_id, overwrite_readme)
        copy_tokenizer_files(getattr(wide, "_source_dirs", None) or [], directory)
        for preprocessor in (tokenizer, processor):
            if preprocessor is not None:
                preprocessor.save_pretrained(directory)
        return directory
    group = wide.members_group  # member-parallel: every rank stacks its members, rank 0 writes (hf_wide.parallel)
    local = range(wide.num_members) if group is None else group.local
    states = [state_tensors(wide.member(i, share=True)) for i in local]  # views, no copies
    shared = [k for k, t in states[0].items() if all(_identical(t, s[k]) for s in states[1:])]
    if group is not None:
        from .parallel import agree_to_save

        shared = agree_to_save(group, wide.plan, states[0], shared)
    writes = group is None or group.rank == 0
    # Plan the shards on meta tensors of the stored shapes, then stack one shard at a time.
    stored = {k: torch.empty(t.shape if k in shared else (wide.num_members, *t.shape), dtype=t.dtype, device="meta")
              for k, t in states[0].items()}
    split = split_torch_state_dict_into_shards(stored, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    if writes:
        for old in chain(directory.glob("model*.safetensors"), directory.glob(WEIGHTS_INDEX_NAME)):
            old.unlink()
    for filename, keys in split.filename_to_tensors.items():
        tensors = {}
        for k in keys:  # (every rank takes part in each gather; only the writer keeps the shard)
            value = states[0][k].detach().clone() if k in shared else _stacked(group, [s[k] for s in states])
            if writes:
                tensors[k] = value
        if group is None:
            save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        else:  # a failure to write on rank 0 raises on every rank, rather than leave them in the next gather
            from .parallel import on_every_rank

            on_every_rank(group, lambda: save_file(tensors, str(directory / filename), metadata={"format": "pt"})
                              if writes else None, f"Writing {filename}")
        del tensors
    if not writes:
        return directory
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    _save_config(wide, directory, shared)
    generation_config = (wide.member_generation_configs or [None])[0]
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    copy_tokenizer_files(getattr(wide, "_source_dirs", None) or [], directory)
    for preprocessor in (tokenizer, processor):
        if preprocessor is not None:
            preprocessor.save_pretrained(directory)
    readme = directory / "README.md"
    if overwrite_readme or not readme.exists():
        readme.write_text(model_card(wide, repo_id))
    return directory


def _stacked(group, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(N, ...)``: the members' tensors stacked; a member-parallel rank's, gathered from every rank."""
    stacked = torch.stack([t.detach() for t in tensors])
    if group is None:
        return stacked
    from .parallel import gather_members

    return gather_members(group, stacked)


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _save_config(wide, directory: Path, shared: Sequence[str]) -> None:
    """config.json: member 0's config (architectures and dtype as stored) plus the ``hf_wide`` section."""
    base = copy.deepcopy((wide.member_configs or [wide.config])[0])
    base.architectures = [wide.plan.model_class]
    floating = [p.dtype for p in wide.parameters() if p.dtype.is_floating_point]
    if floating:
        base.dtype = floating[0]
    base.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data[CONFIG_KEY] = wide_config_section(wide, shared)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def copy_tokenizer_files(source_dirs: Sequence[str | Path], directory: Path) -> list[str]:
    """Copy the tokenizer and processor files of ``source_dirs[0]`` into ``directory`` if every folder holds the
    same ones (byte for byte); warn and copy nothing if they differ. Returns the names copied."""
    if not source_dirs:
        return []
    first = Path(source_dirs[0])
    names = sorted({p.name for pattern in TOKENIZER_PATTERNS for p in first.glob(pattern) if p.is_file()})
    for other in map(Path, source_dirs[1:]):
        other_names = sorted({p.name for pattern in TOKENIZER_PATTERNS for p in other.glob(pattern) if p.is_file()})
        if other_names != names or any((first / n).read_bytes() != (other / n).read_bytes() for n in names):
            warnings.warn(f"The members' tokenizer or processor files differ ({first} and {other}): none were "
                          "saved. Pass tokenizer= (or processor=) to save the one to use.")
            return []
    for name in names:
        shutil.copyfile(first / name, directory / name)
    return names


# ---------------------------------------------------------------- loading a fused repo
def load_fused(cls, folder: str | Path, *, name: str, dtype: torch.dtype | str | None = None, device=None,
               members: range | None = None):
    """A fused repo folder back as a ``cls`` (WideModel), without tracing: the stored plan is reapplied. With
    ``members`` (a member-parallel rank's slice), only those members, and only their bytes are read."""
    import transformers
    from transformers import GenerationConfig

    folder = Path(folder)
    section = read_section(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    delattr(config, CONFIG_KEY)
    n = section["num_members"]
    members = range(n) if members is None else members
    torch_dtype = config.dtype if dtype in (None, "auto") else dtype
    template = empty_model(model_class_for(config, name), config, torch_dtype)
    generation_config = getattr(template, "generation_config", None)
    if generation_config is not None and (folder / "generation_config.json").exists():
        generation_config = GenerationConfig.from_pretrained(folder)
    configs = []
    for i in members:
        labels = {int(k): v for k, v in section["labels"][i].items()}
        configs.append(member_config(template.config, {**section["member_config_overrides"][i], "id2label": labels,
                                                       "label2id": {v: k for k, v in labels.items()},
                                                       "_name_or_path": section["member_ids"][i]}))
    skeletons = [skeleton_like(template, c, copy.deepcopy(generation_config)) for c in configs]
    shared = set(section["shared"])
    with Checkpoint(folder) as ckpt:
        keys = _check_layout(ckpt, template, shared, n, name)

        def read(i: int, key: str, dst: torch.Tensor) -> None:
            ckpt.read_into(keys[key], dst, None if keys[key] in shared else members[i])

        plan = dataclasses.replace(plan_from_dict(section["plan"]), num_members=len(members))
        model, fold, aliases = assemble(skeletons, plan, device, read)
    generation_configs = [copy.deepcopy(generation_config) for _ in members]
    wide = cls(model, plan, fold, aliases, [section["member_ids"][i] for i in members], configs, generation_configs)
    wide.member_revisions = [section["member_revisions"][i] for i in members]
    wide._source_dirs = [folder]
    return wide.eval()


def _check_layout(ckpt: Checkpoint, template: nn.Module, shared: set[str], n: int, name: str) -> dict[str, str]:
    """Map every state-dict name of the template (tied tensors' every name) to its key in the fused file,
    checking the stored shapes."""
    aliases = tensor_aliases(template)
    keys = {}
    for key, t in state_tensors(template).items():
        found = next((a for a in aliases.get(key, [key]) if a in ckpt), None)
        if found is None:
            raise FusedRepoError(f"{name}: the fused repo has no tensor {key!r}, which {type(template).__name__} has.")
        expected = tuple(t.shape) if found in shared else (n, *t.shape)
        if ckpt.shape(found) != expected:
            raise FusedRepoError(f"{name}: the fused repo stores {found!r} with shape {ckpt.shape(found)}, but "
                                 f"{n} members of {type(template).__name__} need {expected}.")
        keys.update(dict.fromkeys(aliases.get(key, [key]), found))  # every name of a tied tensor
    return keys


# ---------------------------------------------------------------- members back as ordinary repos
def save_member(wide, i: int, save_directory: str | Path) -> Path:
    """Member i as an ordinary transformers repo (its config, weights and tokenizer files) in ``save_directory``."""
    member = wide.member(i)
    if not hasattr(member, "save_pretrained"):
        raise TypeError(f"Member {i} is a {type(member).__name__}, not a transformers model: use torch.save.")
    directory = Path(save_directory)
    member.save_pretrained(directory)
    sources = getattr(wide, "_source_dirs", None) or []
    if sources:
        copy_tokenizer_files([sources[i] if len(sources) > 1 else sources[0]], directory)
    return directory


def refuse_peft_without_sources(wide) -> None:
    """PEFT members that were not all loaded as adapters of one base (``from_models``, or full checkpoints among
    the adapters) have no repo layout to save to: neither a transformers class nor an adapter each."""
    if getattr(wide.model, "peft_config", None) is not None and getattr(wide, "adapter_sources", None) is None:
        raise NotImplementedError(
            "hf-wide cannot save this wide model: its members are PEFT models not all loaded as adapters of one base "
            "(from_models, or full checkpoints among the adapters). Save each member with wide.member(i).")


def save_members(wide, save_directory: str | Path, names: Sequence[str] | None = None) -> list[Path]:
    """Every member as an ordinary transformers repo: ``save_directory/member-{i}`` (or ``names[i]``)."""
    names = list(names) if names is not None else [f"member-{i}" for i in range(wide.num_members)]
    if len(names) != wide.num_members:
        raise ValueError(f"Got {len(names)} names for {wide.num_members} members.")
    refuse_peft_without_sources(wide)
    if getattr(wide, "adapter_sources", None) is not None:  # PEFT adapter folders (none for the base itself)
        from .adapter_repos import save_adapter

        return [save_adapter(wide, i, Path(save_directory) / name) for i, name in enumerate(names)]
    return [save_member(wide, i, Path(save_directory) / name) for i, name in enumerate(names)]
