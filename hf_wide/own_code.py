"""Checkpoints with their own code: a config whose ``auto_map`` names classes in the checkpoint's ``.py`` files, which
transformers runs only with ``trust_remote_code=True``.

    klass = own_class(config, name, folder, trust_remote_code=True)   # as transformers' from_pretrained loads it
    save_own_code(type(model), directory)                              # its files beside the saved weights

transformers gives each folder's code a module of its own (``transformers_modules.<folder>.modeling_x``), so two
members' classes are two objects even where their code is one: :func:`same_code` compares the files, and a member
whose code is the same as member 0's is loaded with member 0's class (the members of a wide model are one class).
"""

from __future__ import annotations

import sys
from pathlib import Path


def own_class(config, name: str, folder: str | Path | None, trust_remote_code: bool,
              like: type | None = None) -> type | None:
    """The class of ``config.architectures`` in the checkpoint's own code in ``folder`` (by its config's
    ``auto_map``), or None where the config names none. Refused without ``trust_remote_code``. ``like``: another
    member's class, returned instead where both are the same code."""
    architectures = getattr(config, "architectures", None) or []
    auto_map = getattr(config, "auto_map", None) or {}
    refs = [ref for ref in auto_map.values() if isinstance(ref, str) and ref.rsplit(".", 1)[-1] in architectures]
    if not refs or folder is None:
        return None
    if not trust_remote_code:
        raise ValueError(f"{name}: config.architectures is {architectures!r}, the checkpoint's own code (by its "
                         "config's auto_map): pass trust_remote_code=True to run it, as transformers asks (only for "
                         "code you trust).")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    klass = get_class_from_dynamic_module(refs[0], str(folder))
    return like if like is not None and same_code(klass, like) else klass


def own_code_files(klass: type) -> dict[str, bytes] | None:
    """The files of a checkpoint's own code that define ``klass`` (its module and what that imports relatively), by
    name; None for a class of an installed library."""
    from transformers.dynamic_module_utils import get_relative_import_files

    module = sys.modules.get(klass.__module__)
    if not klass.__module__.startswith("transformers_modules.") or getattr(module, "__file__", None) is None:
        return None
    files = [module.__file__, *get_relative_import_files(module.__file__)]
    return {Path(f).name: Path(f).read_bytes() for f in files}


def same_code(a: type, b: type) -> bool:
    """Whether two classes of checkpoints' own code are one class of one code (each folder's a module apart)."""
    if a is b:
        return True
    files = own_code_files(a)
    return a.__qualname__ == b.__qualname__ and files is not None and files == own_code_files(b)


def save_own_code(klass: type, directory: Path) -> None:
    """The files of the model class ``klass``'s own code (a checkpoint's, loaded with ``trust_remote_code``) into
    ``directory``, as transformers saves them: its config's ``auto_map`` names them, and loading the folder back
    runs them."""
    if own_code_files(klass) is not None:
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(klass, directory)  # (it reads the module of what it is given)
