"""Which generation config each member of a wide model runs: the members' own (``generation_config.json``), what is
set on the wide model's :attr:`~GenerationConfigs.generation_config` since (every member's), and the check that
refuses a ``generate`` that would run one member with another's settings (:func:`check_generation_configs`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any


class GenerationConfigs:
    """The generation configs of :class:`~hf_wide.model.WideModel`: the one ``generate`` runs and the members'."""

    @property
    def generation_config(self):
        """The config ``generate`` runs every member with: as loaded, the first member's held here (member 0's, or a
        member-parallel rank's first). A setting changed on it is every member's, as ``model.generation_config.
        pad_token_id = ...`` sets transformers' (saved, and given to ``member(i)``); a config assigned to it becomes
        every member's."""
        return getattr(self.model, "generation_config", None)

    @generation_config.setter
    def generation_config(self, config) -> None:
        self.model.generation_config = config
        self._run_as_loaded = copy.deepcopy(config)
        if self._generation_configs is not None:
            self.member_generation_configs = [copy.deepcopy(config) for _ in self._generation_configs]

    @property
    def member_generation_configs(self) -> list | None:
        """Each member's own generation config, with the settings changed since on :attr:`generation_config`
        (copies: assign a list to change them); ``None`` for models that do not generate."""
        return with_settings_of(self._generation_configs, self.generation_config, self._run_as_loaded)

    @member_generation_configs.setter
    def member_generation_configs(self, configs: Sequence[Any] | None) -> None:
        self._generation_configs = None if configs is None else list(configs)
        if "_run_as_loaded" not in self.__dict__:  # (set first as the model is built: what changes are read from)
            self._run_as_loaded = copy.deepcopy(self.generation_config)


# What a generation config records of where it came from, not of how to generate
PROVENANCE = frozenset({"transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash"})
# What only sampling reads (transformers' warpers, built where do_sample is set)
SAMPLING = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"})
# A setting given to generate that makes a config's other one moot (transformers: max_new_tokens over max_length)
OVERRIDES = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}


class GenerationConfigsDiffer(ValueError):
    """The members' generation configs differ in ``settings`` (names), which a ``generate`` call does not give;
    ``differences`` says how (``"do_sample: member 0 False, member 1 True"``, one per setting, ``; `` between)."""

    def __init__(self, message: str, settings: list[str], differences: str):
        super().__init__(message)
        self.settings = settings
        self.differences = differences


def check_generation_configs(configs, kwargs: dict) -> None:
    """Refuse a ``generate`` whose members' own generation configs differ in a setting that neither ``kwargs`` nor
    a ``generation_config`` it passes gives: it would run member 0's for every member (transformers fills what a
    passed config leaves unset from the model's, member 0's). The settings are named, with the ways out."""
    if not configs or any(c is None for c in configs):
        return
    passed = kwargs.get("generation_config")
    given = set(kwargs) - {"generation_config"}  # (a None given to generate replaces the config's value)
    if passed is not None:
        given |= {key for key, value in passed.to_dict().items() if value is not None}
    given |= {moot for moot, by in OVERRIDES.items() if by in given}
    defaults = configs[0]._get_default_generation_params()  # what transformers puts where a config says None
    settings = [{key: _one_token(key, defaults.get(key) if value is None else value)
                 for key, value in c.to_dict().items()} for c in configs]
    for theirs in settings:  # [1, 5] ends where [5, 1] does: the order names the pad token only where none is set
        eos = theirs.get("eos_token_id")
        pad = theirs.get("pad_token_id")
        if passed is not None and passed.pad_token_id is not None:
            pad = passed.pad_token_id
        pad = kwargs.get("pad_token_id", pad)  # (a None given unsets it)
        if isinstance(eos, (list, tuple)) and pad is not None:
            theirs["eos_token_id"] = sorted(eos)
    moot = _moot(settings, kwargs, passed)
    differ = {}  # setting -> (the first member whose value differs from member 0's, its value)
    for i, theirs in enumerate(settings[1:], start=1):
        for key in sorted((theirs.keys() | settings[0].keys()) - PROVENANCE - given - moot):
            mine, other = settings[0].get(key), theirs.get(key)
            if mine != other and not (mine in (None, False) and other in (None, False)):  # unset: off
                differ.setdefault(key, (i, other))
    if differ:
        listed = "; ".join(f"{key}: member 0 {settings[0].get(key)!r}, member {i} {value!r}"
                           for key, (i, value) in differ.items())
        first = min(i for i, _ in differ.values())
        give = ", ".join(f"{key}=..." for key in differ)
        raise GenerationConfigsDiffer(
            f"The members' generation configs differ ({listed}), and one generate runs member 0's for every member: "
            f"member {first} would not continue as it does alone. Give the settings to generate (generate(..., "
            f"{give}), or set in the generation_config= it is given) to run every member with them; or run "
            "wide.member(i).generate(...) for a member's own.", list(differ), listed)


def with_settings_of(configs: list | None, run, loaded) -> list | None:
    """Copies of ``configs`` (the members' own generation configs) with the settings in which ``run`` (the config
    generate runs) now differs from ``loaded`` (it as the model was built): those are every member's."""
    if configs is None:
        return None
    configs = [copy.deepcopy(c) for c in configs]
    if run is None or loaded is None or any(c is None for c in configs):
        return configs
    before = loaded.to_dict()
    given = {key: value for key, value in run.to_dict().items() if key not in PROVENANCE and before.get(key) != value}
    for config in configs:
        for key, value in given.items():
            setattr(config, key, value)  # (update() sets only the settings a config has already)
    return configs


def _one_token(key: str, value):
    """A token setting as generate reads it: ``[5]`` ends where ``5`` does."""
    one = key.endswith("token_id") and isinstance(value, (list, tuple)) and len(value) == 1
    return value[0] if one else value


def _moot(settings: list[dict], kwargs: dict, passed) -> frozenset:
    """The settings no member's generate reads in this call: sampling's (transformers' warpers) where none samples.
    ``top_k`` stays with a ``penalty_alpha`` (contrastive search), and a ``temperature=`` given keeps them all
    (Whisper samples as its temperature says, whatever ``do_sample`` is)."""
    def runs_with(key: str) -> list:  # the value of ``key`` each member's generate runs with
        if key in kwargs:
            return [kwargs[key]]
        if passed is not None and getattr(passed, key, None) is not None:
            return [getattr(passed, key)]
        return [theirs.get(key) for theirs in settings]

    if any(runs_with("do_sample")) or "temperature" in kwargs:
        return frozenset()
    return SAMPLING - ({"top_k"} if any(runs_with("penalty_alpha")) else set())
