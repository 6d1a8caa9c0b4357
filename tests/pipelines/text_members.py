"""Tiny text members and local tokenizers whose 100-token vocabulary matches tests/families.py.

Ids: 0 ``[PAD]`` (the families' pad id), 1 ``[SEP]`` (the decoders' eos id), 2 ``[UNK]``, 3 ``[CLS]``,
4 ``[MASK]``, then whole words and ``##`` word pieces, so that words such as ``"catsing"`` split into
sub-tokens (``cat ##s ##ing``) for aggregation tests. Built offline from a generated ``vocab.txt``.

    tok = bert_tokenizer(tmp_path)                 # adds [CLS] ... [SEP], offsets, word pieces
    tok = decoder_tokenizer(tmp_path)              # no special tokens added, left padding, eos = [SEP]
    members = build_members("bert-tokcls", 3)      # tests/families.py members, seeds 0..2
    paths = save_members(tmp_path, members, tok)   # one folder per member, each with the tokenizer
"""

from __future__ import annotations

import random
from pathlib import Path

import transformers
from families import FAMILIES, VOCAB
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["[PAD]", "[SEP]", "[UNK]", "[CLS]", "[MASK]"]
WORDS = (
    "the a an cat dog bird fish sat ran flew swam on in under over mat tree river sky big small red blue green "
    "happy sad fast slow movie film book song great good bad awful loved hated it was is very quite not and but "
    "man woman car house city road paris london alice bob berlin today yesterday we they"
).split()
SUFFIXES = ["s", "ed", "ing", "er", "ly", "est", "ness", "ful"]
PIECES = [f"##{s}" for s in SUFFIXES] + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
TOKENS = SPECIALS + WORDS + PIECES
assert len(TOKENS) == VOCAB, len(TOKENS)
CASES = {case.id: case for case in FAMILIES}


def write_vocab(folder: str | Path) -> Path:
    path = Path(folder) / "vocab.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(TOKENS) + "\n")
    return path


def bert_tokenizer(folder: str | Path) -> transformers.PreTrainedTokenizerBase:
    """A fast BERT tokenizer (WordPiece, ``[CLS] ... [SEP]``, offsets) over the 100-token vocabulary."""
    return transformers.BertTokenizer(str(write_vocab(folder)))


def decoder_tokenizer(folder: str | Path) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer for decoder members: the same word pieces, no special tokens added to prompts, left
    padding, ``[SEP]`` (id 1) as eos and ``[PAD]`` (id 0) as pad."""
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(TOKENS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[SEP]", padding_side="left"
    )


def build_members(case_id: str, n: int = 3, id2label: dict[int, str] | None = None, first_seed: int = 0):
    """n members of a tests/families.py case (seeds first_seed..), optionally with their own label names."""
    members = [CASES[case_id].build(seed) for seed in range(first_seed, first_seed + n)]
    if id2label is not None:
        for member in members:
            member.config.id2label = dict(id2label)
            member.config.label2id = {v: k for k, v in id2label.items()}
    return members


def save_members(folder: str | Path, members, tokenizer) -> list[str]:
    """Save every member with the tokenizer into ``folder/m{i}``; returns the folders."""
    paths = []
    for i, member in enumerate(members):
        path = Path(folder) / f"m{i}"
        member.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def sentences(count: int, seed: int = 0, min_words: int = 2, max_words: int = 9) -> list[str]:
    """Random sentences over the vocabulary; about one word in four carries a suffix (sub-tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS[:-2]) for _ in range(rng.randint(min_words, max_words))]
        words = [w + rng.choice(SUFFIXES) if rng.random() < 0.25 else w for w in words]
        out.append(" ".join(words))
    return out
