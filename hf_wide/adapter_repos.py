"""Saving an ensemble of LoRA adapters: the adapters, with the base referenced, not copied.

A wide model loaded from adapters (:mod:`hf_wide.adapters`) remembers its base (repo id and the commit it was
loaded at) and each member's adapter config. ``save_pretrained`` then writes::

    config.json                       the base's config, with an ``hf_wide`` section: the base, its revision, the
                                      members' ids and revisions, ``adapters`` (one entry per member) and the
                                      ``plan`` they were fused by
    members/member-{i}/               member i's adapter as PEFT writes one (adapter_config.json and
                                      adapter_model.safetensors), or nothing where member i is the base itself
    README.md                         the model card

and ``from_pretrained`` of that folder or repo loads the base (at its revision) and the adapters, as when they
were first loaded, and fuses them by the saved plan, verified rather than traced (``fuse_models``' ``saved_plan``).
``save_members`` writes the same adapter folders, each naming the base it was loaded over (:func:`loaded_over`):
``PeftModel.from_pretrained(base, folder)`` loads each. The zero updates that gave members without an adapter on a
module the same structure are not saved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

MEMBERS_DIR = "members"


@dataclasses.dataclass
class AdapterSources:
    """What a wide model of adapters came from: its base and, per member, the adapter config (None for the base
    itself) and the modules given a zero update."""

    base_model: str
    base_revision: str | None
    configs: list[dict | None]
    padded: list[list[str]]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def save_adapter(wide, i: int, folder: Path) -> Path | None:
    """Member i's adapter as a PEFT adapter folder (None, and nothing written, where member i is the base)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    sources: AdapterSources = wide.adapter_sources
    config = sources.configs[i]
    if config is None:
        return None
    member = wide.member(i, share=True)  # without the zero updates given to targets it lacks
    state, seen = {}, set()
    # The embedding tables whole where the adapter as loaded held them (PEFT's "auto" compares the vocabulary with the
    # base's config at main, fetched from the Hub: a base whose main had moved on got them saved into every adapter,
    # which then wrote into the base's tables and was refused when loaded back)
    original = _original_keys(wide, i)
    plain = get_peft_model_state_dict(member, save_embedding_layers=False)
    whole = original is not None and bool(original - plain.keys())
    for k, v in (get_peft_model_state_dict(member, save_embedding_layers=True) if whole else plain).items():
        v = v.detach().contiguous()
        view = (v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride())
        # PEFT names one tensor twice with bias="all" and modules_to_save (the head's bias), and safetensors
        # refuses aliases: a copy, as PEFT's own save_pretrained makes
        state[k] = v.clone() if view in seen else v
        seen.add(view)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(loaded_over(config, sources), indent=2, sort_keys=True)
                                                + "\n")
    save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def _original_keys(wide, i: int) -> set[str] | None:
    """The tensors member i's adapter file held as it was loaded (None where it is not known)."""
    from safetensors import safe_open

    sources = getattr(wide, "_source_dirs", None) or []
    folder = (Path(sources[i]) if len(sources) == wide.num_members else  # (else a saved ensemble's folder)
              Path(sources[0]) / MEMBERS_DIR / f"member-{i}" if len(sources) == 1 else None)
    path = None if folder is None else folder / "adapter_model.safetensors"
    if path is None or not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def loaded_over(config: dict, sources: AdapterSources) -> dict:
    """An adapter's config naming the base it was loaded over (PEFT's ``base_model_name_or_path`` and ``revision``,
    which ``AutoPeftModel`` loads the base at): after ``base_model=`` (or ``base_revision=``), the config still named
    the base it had named, and its folder, loaded over that one, was another model than the wide model's member
    (2.7 off)."""
    return {**config, "base_model_name_or_path": sources.base_model, "revision": sources.base_revision}


def save_adapter_ensemble(wide, save_directory: str | Path, section: dict, repo_id: str | None = None,
                          overwrite_readme: bool = False) -> Path:
    """``save_pretrained`` of a wide model of adapters (see the module docstring). ``section``: the ``hf_wide``
    section's common fields (format version, member ids and revisions)."""
    from .card import model_card

    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    sources: AdapterSources = wide.adapter_sources
    for i in range(wide.num_members):
        save_adapter(wide, i, folder / MEMBERS_DIR / f"member-{i}")
    config = wide.member_configs[0].to_dict()
    floating = next((p.dtype for p in wide.parameters() if p.is_floating_point()), None)
    if floating is not None:  # the base's, as the wide model holds it (wide.to(torch.bfloat16): loaded back so)
        config["dtype"] = str(floating).removeprefix("torch.")
    config["hf_wide"] = {**section, "adapters": sources.to_dict()}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    readme = folder / "README.md"
    if overwrite_readme or not readme.exists():
        readme.write_text(model_card(wide, repo_id))
    return folder


def adapter_folders(folder: Path, section: dict) -> tuple[list[Path | str], list[dict | None]]:
    """The members' folders (the base's id for a member that is the base) and adapter configs of a saved
    adapter ensemble."""
    sources = section["adapters"]
    folders, configs = [], []
    for i, config in enumerate(sources["configs"]):
        folders.append(folder / MEMBERS_DIR / f"member-{i}" if config is not None else sources["base_model"])
        configs.append(config)
    return folders, configs



