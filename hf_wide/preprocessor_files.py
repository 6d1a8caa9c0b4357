"""The tokenizer, processor and chat-template files of a fused repo: copied from the members' folders where they
all hold the same (an adapter's base's, where it ships none: :func:`tokenizer_folders`), or saved from the
``tokenizer`` and ``processor`` the caller gives (:func:`save_preprocessors`)."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

# Tokenizer, processor and chat-template files: copied into a fused repo from the members' folders.
TOKENIZER_PATTERNS = ["tokenizer*.json", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                      "*.model", "*.tiktoken", "chat_template.*", "*preprocessor_config.json", "processor_config.json"]


def save_preprocessors(wide, directory: Path, tokenizer, processor, earlier: bool) -> None:
    """The members' tokenizer and processor files (where they all hold the same), then ``tokenizer`` and ``processor``
    where given. Over an ``earlier`` fused repo, its own such files go first: left, they were the new repo's
    tokenizer where the members' differ and none is saved."""
    sources = tokenizer_folders(wide)
    if earlier and not any(same_folder(source, directory) for source in sources):
        for path in preprocessor_files(directory):
            path.unlink()
    copy_tokenizer_files(sources, directory)
    for preprocessor in (tokenizer, processor):
        if preprocessor is not None:
            preprocessor.save_pretrained(directory)


def tokenizer_folders(wide) -> list[Path]:
    """The folders that hold the tokenizer and processor files of ``wide``'s sources (``wide._source_dirs``: the
    members' folders, or the one fused repo's): each source's own; or, for a PEFT adapter that ships none, and for
    an ensemble of adapters saved without, its base's (the folder its model config was loaded from). PEFT saves an
    adapter alone, and it reads text with its base's tokenizer, as a pipeline over the adapters does
    (:func:`hf_wide.pipelines.loading.preprocessor_sources`): without its base's files, a fused repo of adapters
    held no tokenizer, and the base in the list beside its adapters was taken to differ from them."""
    sources = [Path(s) for s in getattr(wide, "_source_dirs", None) or []]
    configs = wide.member_configs or [wide.config]
    of_adapters = getattr(wide, "adapter_sources", None) is not None
    folders = []
    for i, source in enumerate(sources):
        base = getattr(configs[min(i, len(configs) - 1)], "_name_or_path", None)  # (one source: the fused repo's)
        if (base and Path(base).is_dir() and not preprocessor_files(source)
                and (of_adapters or (source / "adapter_config.json").is_file())):  # (merged adapters: full members)
            source = Path(base)
        folders.append(source)
    return folders


def preprocessor_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in TOKENIZER_PATTERNS for p in folder.glob(pattern) if p.is_file()})


def same_folder(a: str | Path, b: str | Path) -> bool:
    return Path(a).exists() and Path(b).exists() and Path(a).samefile(b)


def copy_tokenizer_files(source_dirs: Sequence[str | Path], directory: Path) -> list[str]:
    """Copy the tokenizer and processor files of ``source_dirs[0]`` into ``directory`` if every folder holds the
    same ones (byte for byte); warn and copy nothing if they differ. Returns the names copied."""
    if not source_dirs:
        return []
    first = Path(source_dirs[0])
    names = [p.name for p in preprocessor_files(first)]
    for other in map(Path, source_dirs[1:]):
        other_names = [p.name for p in preprocessor_files(other)]
        if other_names != names or any((first / n).read_bytes() != (other / n).read_bytes() for n in names):
            warnings.warn(f"The members' tokenizer or processor files differ ({first} and {other}): none were "
                          "saved. Pass tokenizer= (or processor=) to save the one to use.")
            return []
    if same_folder(first, directory):  # saved where it was loaded from: the files are there
        return names
    for name in names:
        shutil.copyfile(first / name, directory / name)
    return names
