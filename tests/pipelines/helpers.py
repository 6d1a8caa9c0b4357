"""Tiny text members saved as checkpoint folders with a local tokenizer (vocab of the families' 100 ids)."""

from pathlib import Path

from transformers import BertTokenizer

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(len(SPECIAL), 100)]  # ids 5..99


def make_tokenizer(folder: Path) -> BertTokenizer:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n")
    return BertTokenizer(str(vocab), model_max_length=64)


def text(*word_ids: int) -> str:
    return " ".join(f"w{i}" for i in word_ids)


def save_members(models, tokenizer, root: Path) -> list[str]:
    paths = []
    for i, model in enumerate(models):
        path = root / f"member-{i}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths
