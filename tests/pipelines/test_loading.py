"""What a pipeline takes: the members' tokenizer or image processor, loaded once (hf_wide/pipelines/loading.py), the one
they share or a refusal that names the member, never a preprocessor that would read the inputs wrongly; and members
with the head its task reads (hf_wide/pipelines/base.py)."""

from pathlib import Path

import pytest
import transformers
from huggingface_hub import constants
from conftest import CASES
from hub_server import hub  # noqa: F401
from text_members import bert_tokenizer, build_members, decoder_tokenizer, save_members

from hf_wide import WideModel, pipeline

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
    expected = pipeline("text-classification", model=with_files)(TEXTS)
    assert pipeline("text-classification", model=paths, tokenizer=tokenizer)(TEXTS) == expected
    # by its folder (or repo id), as transformers' pipeline takes it: was kept as a string, and failed when called
    assert pipeline("text-classification", model=paths, tokenizer=Path(with_files[0]))(TEXTS) == expected
    with pytest.raises(ValueError, match=rf"tokenizer of {paths[1]} has no vocabulary"):
        pipeline("text-classification", model=paths, tokenizer=paths[1])


def test_members_from_the_hub_and_from_folders_share_their_tokenizer(members, tmp_path, hub):
    # The tokenizer's record of where it came from (is_local) differed, and the members were refused as reading
    # differently: the README's first example (Hub repos and a local folder) could not run a pipeline.
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    hub.publish("alice/m0", paths[0])
    assert pipeline("text-classification", model=["alice/m0", paths[1]])(TEXTS) == pipeline(
        "text-classification", model=paths)(TEXTS) == pipeline(
        "text-classification", model=[Path(p) for p in paths])(TEXTS)  # folders as paths, as transformers takes them


def test_the_tokenizer_is_read_from_the_cache_the_members_were(members, tmp_path, hub):  # noqa: F811
    """``model_kwargs={"cache_dir": ...}`` held the members' files and not their tokenizer's, which went to the default
    cache: offline, with the default cache empty, the pipeline could not load it."""
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    for i, path in enumerate(paths):
        hub.publish(f"alice/cached-{i}", path)
    ids, options = ["alice/cached-0", "alice/cached-1"], {"cache_dir": str(tmp_path / "mine")}
    online = pipeline("text-classification", model=ids, model_kwargs=options)(TEXTS)
    assert not list(Path(constants.HF_HUB_CACHE).glob("models--alice--cached-*"))  # nothing in the default cache
    assert list((tmp_path / "mine").glob("models--alice--cached-0/snapshots/*/tokenizer.json"))
    offline = pipeline("text-classification", model=ids, model_kwargs={**options, "local_files_only": True})(TEXTS)
    assert offline == online


def test_members_whose_tokenizers_differ_are_refused(members, tmp_path):
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    other = transformers.BertTokenizer(str(tmp_path / "tok" / "vocab.txt"), do_lower_case=False)
    other.save_pretrained(paths[1])
    with pytest.raises(ValueError, match=rf"Member 1 \({paths[1]}\) has a different tokenizer from member 0"):
        pipeline("text-classification", model=paths)


def test_members_whose_folders_each_hold_the_same_vocab_file_share_their_tokenizer(members, tmp_path):
    # A folder with a vocab.txt (BERT's, as transformers 4 saved them: most fine-tunes on the Hub) has transformers
    # record that file's path in the tokenizer's init_kwargs: the members' paths differ, and identical tokenizers
    # were refused as different. Their files' bytes are compared now; a vocabulary that differs still refuses.
    tokenizer = bert_tokenizer(tmp_path / "tok")
    paths = save_members(tmp_path / "same", members, tokenizer)
    for path in paths:
        (Path(path) / "vocab.txt").write_bytes((tmp_path / "tok" / "vocab.txt").read_bytes())
    assert transformers.AutoTokenizer.from_pretrained(paths[0]).init_kwargs["vocab_file"].startswith(paths[0])
    assert pipeline("text-classification", model=paths)(TEXTS) == pipeline(
        "text-classification", model=paths, tokenizer=tokenizer)(TEXTS)
    other = Path(paths[1]) / "vocab.txt"
    other.write_text(other.read_text().replace("movie", "film-x"))
    (Path(paths[1]) / "tokenizer.json").unlink(missing_ok=True)  # (read from the vocab.txt)
    with pytest.raises(ValueError, match=r"Member 1 .* has a different tokenizer from member 0"):
        pipeline("text-classification", model=paths)


def test_image_members_without_an_image_processor_are_refused(tmp_path):
    path = tmp_path / "vit"
    CASES["vit-imgcls"].build(0).save_pretrained(path)
    with pytest.raises(ValueError, match=r"Could not load an image_processor for member 0 .*Pass image_processor="):
        pipeline("image-classification", model=[str(path), str(path)])
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "processor")
    pipe = pipeline("image-classification", model=[str(path), str(path)], image_processor=str(tmp_path / "processor"))
    assert pipe.image_processor.size == {"height": 32, "width": 32}
    with pytest.raises(TypeError, match="takes a loaded tokenizer or image processor"):
        type(pipe)(pipe.model, image_processor=str(tmp_path / "processor"))


@pytest.mark.parametrize("task, case, head", [
    ("text-classification", "llama-causallm", "a sequence-classification head"),
    ("text-classification", "bert-tokcls", "a sequence-classification head"),
    ("token-classification", "bert-seqcls", "a token-classification head"),
    ("text-generation", "bert-seqcls", "a language-modeling head"),
    ("image-classification", "bert-seqcls", "an image-classification head"),
])
def test_members_with_another_tasks_head_are_refused(tmp_path, task, case, head):
    # (they failed deep inside: "Index tensor must have the same number of dimensions", "'SequenceClassifierOutput'
    # object has no attribute 'cache'", ...)
    members = build_members(case, 2)
    tokenizer = (decoder_tokenizer if "causallm" in case else bert_tokenizer)(tmp_path)
    with pytest.raises(ValueError, match=rf"{task} runs members with {head} .*these are {type(members[0]).__name__}"):
        pipeline(task, model=WideModel.from_models(members), tokenizer=tokenizer, image_processor=object())


def test_feature_extraction_takes_any_head_and_lora_members_are_known_by_their_base(tmp_path):
    from lora_members import adapted

    tokenizer = bert_tokenizer(tmp_path)
    assert pipeline("feature-extraction", model=WideModel.from_models(build_members("bert-seqcls", 2)),
                    tokenizer=tokenizer)("a cat")
    base = build_members("bert-seqcls", 1)[0]
    lora = WideModel.from_models([adapted(base, s, r=4, target_modules=["query", "value"]) for s in range(2)])
    assert pipeline("text-classification", model=lora, tokenizer=tokenizer)("a cat")["label"]
    with pytest.raises(ValueError, match="token-classification runs members with a token-classification head.*"
                                         "these are BertForSequenceClassification"):
        pipeline("token-classification", model=lora, tokenizer=tokenizer)


def test_adapters_without_tokenizer_files_read_with_their_bases_tokenizer(tmp_path, hub, monkeypatch):
    """PEFT saves an adapter alone (was: "Could not load a tokenizer for member 0"): the pipeline reads with its
    base's tokenizer, at the base's commit; an adapter that ships a tokenizer reads with its own."""
    from huggingface_hub import constants
    from lora_members import save_adapter

    bert = CASES["bert-seqcls"]
    tokenizer = bert_tokenizer(tmp_path / "tok")
    other = transformers.BertTokenizer(str(tmp_path / "tok" / "vocab.txt"), do_lower_case=False)  # another setting
    bert.build(0).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    other.save_pretrained(tmp_path / "other")
    options = dict(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    adapters = [save_adapter(bert, tmp_path / "base", tmp_path / f"a{s}", s, **options) for s in range(2)]
    expected = pipeline("text-classification", model=adapters, tokenizer=tokenizer)(TEXTS)
    pipe = pipeline("text-classification", model=adapters)
    assert pipe.tokenizer.init_kwargs["do_lower_case"] and pipe(TEXTS) == expected

    # on the Hub, the base since given another tokenizer: the adapters' pinned base, with its own
    pinned = hub.publish("alice/base", tmp_path / "base")
    hub.publish("alice/base", tmp_path / "other")
    for s in range(2):
        hub.publish(f"alice/a{s}", save_adapter(bert, tmp_path / "base", tmp_path / f"hub-a{s}", s,
                                                base_name="alice/base", **options))
    pipe = pipeline("text-classification", model=["alice/a0", "alice/a1"], model_kwargs={"base_revision": pinned})
    assert pipe.tokenizer.init_kwargs["do_lower_case"] and pipe(TEXTS) == expected
    with monkeypatch.context() as offline:  # and offline, from what the cache learnt online
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        offline.setenv("HF_HUB_OFFLINE", "1")
        seen = len(hub.requests)
        pipe = pipeline("text-classification", model=["alice/a0", "alice/a1"], model_kwargs={"base_revision": pinned})
        assert pipe(TEXTS) == expected and len(hub.requests) == seen

    for adapter in adapters:  # adapters with tokenizers of their own
        other.save_pretrained(adapter)
    assert pipeline("text-classification", model=adapters).tokenizer.init_kwargs["do_lower_case"] is False


def test_members_pinned_at_a_revision_read_with_that_revisions_tokenizer(members, tmp_path, hub):
    """The tokenizer came from each repo's main branch whatever revision the weights were pinned at."""
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    pinned = [hub.publish(f"alice/m{i}", path) for i, path in enumerate(paths)]
    transformers.BertTokenizer(str(tmp_path / "tok" / "vocab.txt"), do_lower_case=False).save_pretrained(
        tmp_path / "other")
    for i in range(2):
        hub.publish(f"alice/m{i}", tmp_path / "other")
    pipe = pipeline("text-classification", model=["alice/m0", "alice/m1"], revision=pinned)
    assert pipe.tokenizer.init_kwargs["do_lower_case"]
    assert pipeline("text-classification", model=["alice/m0", "alice/m1"]).tokenizer.init_kwargs[
        "do_lower_case"] is False
