"""The members' tokenizer or image processor, loaded once for a pipeline (hf_wide/pipelines/loading.py): the one they
share, or a refusal that names the member, never a preprocessor that would read the inputs wrongly."""

import pytest
import transformers
from conftest import CASES
from text_members import bert_tokenizer, save_members

from hf_wide import pipeline

TEXTS = ["the cat sat on the mat", "a good movie"]


@pytest.fixture(scope="module")
def members():
    return [CASES["bert-seqcls"].build(seed) for seed in range(2)]


def test_members_saved_without_tokenizer_files_are_refused_not_read_as_unknown_words(members, tmp_path):
    # transformers 5 makes an empty BertTokenizer of a folder with no tokenizer files: every word [UNK], silently.
    paths = []
    for i, member in enumerate(members):
        member.save_pretrained(tmp_path / f"m{i}")
        paths.append(str(tmp_path / f"m{i}"))
    assert len(transformers.AutoTokenizer.from_pretrained(paths[0]).get_vocab()) == 5  # what it would have read with
    with pytest.raises(ValueError, match=rf"tokenizer of member 0 \({paths[0]}\) has no vocabulary.*Pass tokenizer="):
        pipeline("text-classification", model=paths)
    tokenizer = bert_tokenizer(tmp_path / "tok")  # the way out: the tokenizer they were trained with
    with_files = save_members(tmp_path / "with", members, tokenizer)
    assert pipeline("text-classification", model=paths, tokenizer=tokenizer)(TEXTS) == pipeline(
        "text-classification", model=with_files)(TEXTS)


def test_members_whose_tokenizers_differ_are_refused(members, tmp_path):
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    other = transformers.BertTokenizer(str(tmp_path / "tok" / "vocab.txt"), do_lower_case=False)
    other.save_pretrained(paths[1])
    with pytest.raises(ValueError, match=rf"Member 1 \({paths[1]}\) has a different tokenizer from member 0"):
        pipeline("text-classification", model=paths)


def test_image_members_without_an_image_processor_are_refused(tmp_path):
    path = tmp_path / "vit"
    CASES["vit-imgcls"].build(0).save_pretrained(path)
    with pytest.raises(ValueError, match=r"Could not load an image_processor for member 0 .*Pass image_processor="):
        pipeline("image-classification", model=[str(path), str(path)])
