"""The Hub side of :class:`~hf_wide.WideModel`: loading, saving and uploading, as transformers models have them.

    wide = WideModel.from_pretrained(["org/a", "org/b"])   # members fused, or one fused repo loaded back
    wide.save_pretrained("./wide")                         # one fused repo: stacked weights, config, card
    wide.push_to_hub("user/wide-ensemble")                 # the same, uploaded in one commit
    wide.save_members("./members")                         # every member as an ordinary repo again

Each method hands the work to the module that does it (:mod:`hf_wide.hub`, :mod:`hf_wide.saving`,
:mod:`hf_wide.export`), imported when called: the model's own module stays free of Hub I/O.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import WideModel


class WideHubMixin:
    """``from_pretrained``, ``save_pretrained``, ``push_to_hub``, ``save_members`` and ``push_members`` of
    :class:`~hf_wide.WideModel`."""

    @classmethod
    def from_pretrained(cls, model_ids: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs) -> "WideModel":
        """Download (or read) N checkpoints and fuse them, or load one fused repo (a single id whose config.json
        has an ``hf_wide`` section, as written by :meth:`save_pretrained`). Options (``revision``, ``dtype``,
        ``device``, ``device_map``, ``token``, ``allow_pickle``, ...): see :func:`hf_wide.hub.load_wide`."""
        from .hub import load_wide

        return load_wide(cls, model_ids, **kwargs)

    def save_pretrained(self, save_directory, *, max_shard_size: int | str = "5GB", tokenizer=None, processor=None,
                        overwrite_readme: bool = False):
        """Write one fused repo (stacked weights, config with an ``hf_wide`` section, tokenizer files, model card)
        that :meth:`from_pretrained` loads back. See :func:`hf_wide.saving.save_wide`."""
        from .saving import save_wide

        return save_wide(self, save_directory, max_shard_size=max_shard_size, tokenizer=tokenizer,
                         processor=processor, overwrite_readme=overwrite_readme)

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str | None = None, create_pr: bool = False, revision: str | None = None,
                    overwrite_readme: bool = False, max_shard_size: int | str = "5GB", tokenizer=None,
                    processor=None):
        """Upload the fused repo to ``repo_id`` in one commit (to branch ``revision``, made from main if it is not
        there, as transformers' ``push_to_hub`` does); a README already there is kept unless ``overwrite_readme``.
        See :func:`hf_wide.export.push_wide`."""
        from .export import push_wide

        return push_wide(self, repo_id, private=private, token=token, commit_message=commit_message,
                         create_pr=create_pr, revision=revision, overwrite_readme=overwrite_readme,
                         max_shard_size=max_shard_size, tokenizer=tokenizer, processor=processor)

    def save_members(self, save_directory, names: Sequence[str] | None = None):
        """Every member as an ordinary transformers repo in ``save_directory/member-{i}``: the inverse of fusion
        (adapters as PEFT adapter folders, the base among them as its own repo)."""
        from .export import save_members

        return save_members(self, save_directory, names)

    def push_members(self, repo_ids: Sequence[str], *, private: bool | None = None, token: str | None = None,
                     commit_message: str | None = None):
        """Upload member i as an ordinary transformers repo to ``repo_ids[i]``."""
        from .export import push_members

        return push_members(self, repo_ids, private=private, token=token, commit_message=commit_message)
