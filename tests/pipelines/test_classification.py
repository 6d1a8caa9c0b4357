"""Text and image classification pipelines: the ensemble equals the combination of the members run
alone, each member's result equals its own transformers pipeline, and bad input gets clear errors."""

import numpy as np
import pytest
import torch
import transformers
from conftest import CASES
from text_members import bert_tokenizer, decoder_tokenizer, save_members, sentences
from PIL import Image

from hf_wide import WideModel, pipeline

N = 3
TEXTS = [*sentences(2, seed=1), sentences(1, seed=2, min_words=20, max_words=20)[0], "cat"]


@pytest.fixture(scope="module")
def text_members(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-members")
    tokenizer = bert_tokenizer(root / "tokenizer")
    models = [CASES["bert-seqcls"].build(seed) for seed in range(N)]
    return models, tokenizer, save_members(root, models, tokenizer)


@pytest.fixture(scope="module")
def pipe(text_members):
    return pipeline("text-classification", model=text_members[2])


def test_model_kwargs_go_to_from_pretrained_as_in_transformers(text_members, pipe):
    eager = pipeline("text-classification", model=text_members[2], model_kwargs={"attn_implementation": "eager"})
    assert eager.model.config._attn_implementation == "eager" != pipe.model.config._attn_implementation
    assert [r["label"] for r in eager(TEXTS)] == [r["label"] for r in pipe(TEXTS)]


def member_probs(models, tokenizer, texts):
    with torch.no_grad():
        return torch.stack([m(**tokenizer(texts, return_tensors="pt", padding=True)).logits.softmax(-1) for m in models])


def test_ensemble_equals_the_mean_of_members_run_alone(pipe, text_members):
    models, tokenizer, _ = text_members
    results = pipe(TEXTS, batch_size=3)
    probs = member_probs(models, tokenizer, TEXTS)  # (N, B, C)
    labels = models[0].config.id2label
    for b, result in enumerate(results):
        mean = probs[:, b].mean(0)
        assert result["label"] == labels[int(mean.argmax())]
        assert result["score"] == pytest.approx(float(mean.max()), abs=1e-5)
        entropy = -(mean * mean.log()).sum()
        expected = -(probs[:, b] * probs[:, b].log()).sum(-1).mean()
        u = result["uncertainty"]
        assert u["predictive_entropy"] == pytest.approx(float(entropy), abs=1e-5)
        assert u["expected_entropy"] == pytest.approx(float(expected), abs=1e-5)
        assert u["mutual_information"] == pytest.approx(float(entropy - expected), abs=1e-5)
        chosen = int(mean.argmax())
        assert u["agreement"] == pytest.approx(float((probs[:, b].argmax(-1) == chosen).float().mean()))
        assert u["member_std"] == pytest.approx(float(probs[:, b, chosen].std(unbiased=False)), abs=1e-5)


def test_each_member_equals_its_own_transformers_pipeline(pipe, text_members):
    models, tokenizer, _ = text_members
    ours = pipe(TEXTS)
    for i, model in enumerate(models):
        theirs = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer)(TEXTS)
        for mine, reference in zip(ours, theirs):
            assert mine["members"][i]["label"] == reference["label"]
            assert mine["members"][i]["score"] == pytest.approx(reference["score"], abs=1e-5)


def test_text_pairs_as_transformers_takes_them(pipe, text_members):
    # natural language inference: a premise and its hypothesis, joined by the tokenizer (token_type_ids apart),
    # beside single texts in one call
    models, tokenizer, _ = text_members
    pairs = [{"text": TEXTS[0], "text_pair": TEXTS[1]}, {"text": TEXTS[2], "text_pair": "cat"}]
    ours = pipe([pairs[0], TEXTS[3], pairs[1]], batch_size=2)
    assert ours[1]["label"] == pipe(TEXTS[3])["label"]
    for i, model in enumerate(models):
        theirs = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer)
        for mine, pair in zip((ours[0], ours[2]), pairs):
            reference = theirs(pair)
            assert mine["members"][i]["label"] == reference["label"]
            assert mine["members"][i]["score"] == pytest.approx(reference["score"], abs=1e-5)
    with pytest.raises(TypeError, match="'text' and 'text_pair'"):
        pipe({"text": TEXTS[0], "pair": TEXTS[1]})


def test_top_k_none_ranks_every_label_as_transformers_does(pipe, text_members):
    models, tokenizer, _ = text_members
    every = pipe(TEXTS[0], top_k=None)["top_k"]
    assert every == pipe(TEXTS[0], top_k=models[0].config.num_labels)["top_k"]
    assert [e["score"] for e in every] == sorted((e["score"] for e in every), reverse=True)
    assert "top_k" not in pipe(TEXTS[0])


def test_batches_sorted_by_length_keep_the_input_order(pipe):
    one_by_one = [pipe(t) for t in TEXTS]
    batched = pipe(TEXTS, batch_size=2)
    for single, together in zip(one_by_one, batched):
        assert single["label"] == together["label"]
        assert single["score"] == pytest.approx(together["score"], abs=1e-5)


@pytest.mark.parametrize("rule", ["logit_mean", "vote", "median"])
def test_other_rules_follow_combine(pipe, text_members, rule):
    result = pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, combine=rule)(TEXTS[0])
    assert set(result) == {"label", "score", "members", "uncertainty"}
    if rule == "vote":
        assert any(result["score"] == pytest.approx(k / N) for k in range(1, N + 1))


def test_weighted_and_none(pipe, text_members):
    models, tokenizer, _ = text_members
    weighted = pipeline("text-classification", model=pipe.model, tokenizer=tokenizer, combine="weighted",
                        weights=[0, 0, 1])(TEXTS[1])
    alone = member_probs(models[2:], tokenizer, [TEXTS[1]])[0, 0]
    assert weighted["score"] == pytest.approx(float(alone.max()), abs=1e-5)
    none = pipeline("text-classification", model=pipe.model, tokenizer=tokenizer, combine="none")(TEXTS[1])
    assert set(none) == {"members"} and len(none["members"]) == N
    entropy = float(-(alone * alone.log()).sum())  # the answer is member 2's, and so is its uncertainty
    assert weighted["uncertainty"]["predictive_entropy"] == pytest.approx(entropy, abs=1e-5)
    assert weighted["uncertainty"]["mutual_information"] == 0.0 and weighted["uncertainty"]["agreement"] == 1.0
    with pytest.raises(ValueError, match="combine='none' has no ensemble answer"):
        pipeline("text-classification", model=pipe.model, tokenizer=tokenizer, combine="none")(TEXTS[1], top_k=2)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), "2", 0])
def test_a_temperature_that_is_no_positive_finite_number_is_refused(pipe, text_members, temperature):
    models, tokenizer, _ = text_members  # (a NaN answered NaN scores; a string raised a bare TypeError)
    with pytest.raises(ValueError, match="positive finite number"):
        pipeline("text-classification", model=pipe.model, tokenizer=tokenizer, temperature=temperature)


def test_top_k(pipe):
    result = pipe(TEXTS[0], top_k=2)
    assert len(result["top_k"]) == 2 and result["top_k"][0]["label"] == result["label"]
    assert result["top_k"][0]["score"] >= result["top_k"][1]["score"]


def test_members_with_permuted_labels_are_realigned(text_members, tmp_path):
    models, tokenizer, _ = text_members
    permuted = CASES["bert-seqcls"].build(N - 1)
    order = [2, 0, 1]
    with torch.no_grad():
        permuted.classifier.weight.copy_(models[N - 1].classifier.weight[order])
        permuted.classifier.bias.copy_(models[N - 1].classifier.bias[order])
    names = models[0].config.id2label
    permuted.config.id2label = {i: names[o] for i, o in enumerate(order)}
    permuted.config.label2id = {v: k for k, v in permuted.config.id2label.items()}
    straight = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
    mixed = pipeline("text-classification", model=WideModel.from_models(models[:-1] + [permuted],
                                                                          allow_label_mismatch=True), tokenizer=tokenizer)
    for a, b in zip(straight(TEXTS), mixed(TEXTS)):
        assert a["label"] == b["label"] and a["score"] == pytest.approx(b["score"], abs=1e-6)
    # members the pipeline loads: the option the refusal names, given to the pipeline as it says (it was refused
    # again, taken only in model_kwargs)
    paths = save_members(tmp_path, models[:-1] + [permuted], tokenizer)
    with pytest.raises(ValueError, match="allow_label_mismatch=True"):
        pipeline("text-classification", model=paths)
    loaded = pipeline("text-classification", model=paths, allow_label_mismatch=True)
    assert loaded(TEXTS) == mixed(TEXTS)
    with pytest.raises(ValueError, match="applies to members the pipeline loads"):
        pipeline("text-classification", model=mixed.model, tokenizer=tokenizer, allow_label_mismatch=True)


def test_multi_label(text_members):
    models, tokenizer, _ = text_members
    for m in models:
        m.config.problem_type = "multi_label_classification"
    try:
        pipe = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
        result = pipe(TEXTS[0])
    finally:
        for m in models:
            m.config.problem_type = None
    with torch.no_grad():
        sig = torch.stack([m(**tokenizer(TEXTS[0], return_tensors="pt")).logits.sigmoid()[0] for m in models]).mean(0)
    assert [r["label"] for r in result["labels"]] == [models[0].config.id2label[int(i)]
                                                      for i in sig.argsort(descending=True) if sig[i] > 0.5]


def test_bad_input(pipe):
    with pytest.raises(ValueError, match="empty text"):
        pipe("   ")
    with pytest.raises(ValueError, match="empty list"):
        pipe([])
    with pytest.raises(ValueError, match="Unknown combine rule 'average'"):
        pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, combine="average")
    with pytest.raises(ValueError, match="one number per member"):
        pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, combine="weighted", weights=[1, 2])
    with pytest.raises(TypeError, match="unknown options: colour"):
        pipe(TEXTS[0], colour="red")
    with pytest.raises(ValueError, match="Unknown task 'translation'"):
        pipeline("translation", model=pipe.model)
    # options that were dropped or failed deep inside: weights without the rule that reads them, a batch size or
    # top_k that is no whole number (a negative batch size answered None for every input)
    with pytest.raises(ValueError, match="weights= are read by combine='weighted' only, and combine is 'mean'"):
        pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, weights=[1, 0, 0])
    for bad in (-1, 0, 1.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be a whole number of at least 1, got {bad!r}"):
            pipe(TEXTS, batch_size=bad)
    for bad in ("2", 2.5, 0):
        with pytest.raises(ValueError, match=f"top_k must be a whole number of at least 1, got {bad!r}"):
            pipe(TEXTS[0], top_k=bad)
    assert pipe(TEXTS[0], top_k=np.int64(2)) == pipe(TEXTS[0], top_k=2)


def test_device_minus_one_is_where_the_model_is_as_in_transformers(pipe):
    same = pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, device=-1)
    assert same.device == torch.device("cpu") and same(TEXTS) == pipe(TEXTS)
    assert pipeline("text-classification", model=pipe.model, tokenizer=pipe.tokenizer, device=-2).device.type == "cpu"


def test_over_long_text_is_truncated_unless_refused(pipe):
    long_text = " ".join(["cat"] * 500)
    assert pipe(long_text)["label"] in pipe.model.config.id2label.values()
    with pytest.raises(ValueError, match="over the model's maximum of 64"):
        pipe(long_text, truncation=False)


def test_positions_counted_past_the_padding_row_bound_the_input(tmp_path):
    # RoBERTa's positions start at padding_idx + 1 (here 2), so a table of 64 rows takes 62 tokens. With a tokenizer
    # that sets no model_max_length, a longer text was cut at 64 and indexed past the table (an IndexError).
    tokenizer = bert_tokenizer(tmp_path / "tok")
    models = [CASES["roberta-seqcls"].build(seed) for seed in range(2)]
    pipe = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
    assert tokenizer.model_max_length > 10**6
    long_text = " ".join(["cat"] * 80)
    result = pipe(long_text)
    encoded = tokenizer(long_text, truncation=True, max_length=62, return_tensors="pt")
    with torch.no_grad():
        alone = [m(**encoded).logits[0].softmax(-1) for m in models]
    assert result["score"] == pytest.approx(float(torch.stack(alone).mean(0).max()), abs=1e-5)
    with pytest.raises(ValueError, match="over the model's maximum of 62"):
        pipe(long_text, truncation=False)


# ---------------------------------------------------------------- images

@pytest.fixture(scope="module")
def image_pipe():
    processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3)
    models = [CASES["vit-imgcls"].build(seed) for seed in range(N)]
    return models, processor, pipeline("image-classification", model=WideModel.from_models(models),
                                       image_processor=processor)


def test_image_classification_equals_members_alone(image_pipe):
    models, processor, pipe = image_pipe
    images = [Image.fromarray((torch.rand(20, 24, 3) * 255).byte().numpy()) for _ in range(3)]
    results = pipe(images)
    pixels = processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        probs = torch.stack([m(pixel_values=pixels).logits.softmax(-1) for m in models]).mean(0)
    for b, result in enumerate(results):
        assert result["score"] == pytest.approx(float(probs[b].max()), abs=1e-5)


def test_a_photo_is_read_upright_as_transformers_reads_it(image_pipe, tmp_path):
    # A JPEG whose EXIF orientation tag says "rotate 90": transformers' pipeline turns it upright before scoring it.
    models, processor, pipe = image_pipe
    image = Image.fromarray((torch.rand(16, 30, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    exif = image.getexif()
    exif[0x0112] = 6
    path = tmp_path / "photo.jpg"
    image.save(path, exif=exif.tobytes())
    for given in (str(path), Image.open(path)):
        theirs = [transformers.pipeline("image-classification", model=m, image_processor=processor)(
            given if isinstance(given, str) else Image.open(path), top_k=None) for m in models]
        scores = pipe(given, top_k=None)["top_k"]
        for entry in scores:
            mean = sum(next(t["score"] for t in member if t["label"] == entry["label"]) for member in theirs) / len(models)
            assert entry["score"] == pytest.approx(mean, abs=1e-5)


def test_images_of_other_modes_are_converted(image_pipe):
    _, _, pipe = image_pipe
    rgba = Image.new("RGBA", (16, 16), (10, 200, 30, 128))
    grey = Image.new("L", (16, 16), 77)
    assert pipe(rgba)["label"] and pipe(grey)["label"]
    with pytest.raises(TypeError, match="Expected a PIL image"):
        pipe(42)
    with pytest.raises(FileNotFoundError):
        pipe("/no/such/image.png")


def test_function_to_apply_as_transformers_takes_it(pipe, text_members):
    models, tokenizer, _ = text_members
    ours = pipe(TEXTS[0], function_to_apply="sigmoid", top_k=None)["top_k"]
    theirs = [transformers.pipeline("text-classification", model=m, tokenizer=tokenizer)(
        TEXTS[0], function_to_apply="sigmoid", top_k=None) for m in models]
    for entry in ours:  # each label on its own: the members' sigmoids, averaged
        mean = sum(next(t["score"] for t in member if t["label"] == entry["label"]) for member in theirs) / len(models)
        assert entry["score"] == pytest.approx(mean, abs=1e-6)
    best = max(ours, key=lambda entry: entry["score"])  # the best label and its score, as transformers answers
    assert pipe(TEXTS[0], function_to_apply="sigmoid")["label"] == best["label"]
    assert pipe(TEXTS[0], function_to_apply="softmax") == pipe(TEXTS[0])
    assert pipe(TEXTS[0], function_to_apply="SIGMOID") == pipe(TEXTS[0], multi_label=True)
    with pytest.raises(ValueError, match="no meaning for an ensemble"):
        pipe(TEXTS[0], function_to_apply="none")
    with pytest.raises(ValueError, match="must be 'softmax' or 'sigmoid'"):
        pipe(TEXTS[0], function_to_apply="relu")
    with pytest.raises(ValueError, match="disagree"):
        pipe(TEXTS[0], function_to_apply="softmax", multi_label=True)


def one_logit_members(problem_type=None):
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=1,
                                     initializer_range=0.3, problem_type=problem_type)
    built = []
    for seed in range(N):
        torch.manual_seed(seed)
        built.append(transformers.BertForSequenceClassification(config).eval())
    return built


def test_a_head_of_one_logit_is_scored_by_its_sigmoid_as_transformers_scores_it(text_members):
    # A softmax over one label scored 1.0 for every member and every text, and the ensemble was certain.
    tokenizer = text_members[1]
    models = one_logit_members()
    pipe = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
    for text, result in zip(TEXTS, pipe(TEXTS, batch_size=2)):
        theirs = [transformers.pipeline("text-classification", model=m, tokenizer=tokenizer)(text)[0] for m in models]
        assert [m["label"] for m in result["members"]] == [t["label"] for t in theirs] == ["LABEL_0"] * N
        scores = [t["score"] for t in theirs]
        assert [m["score"] for m in result["members"]] == pytest.approx(scores, abs=1e-5)
        assert result["label"] == "LABEL_0" and result["score"] == pytest.approx(sum(scores) / N, abs=1e-5)
        assert result["uncertainty"]["member_std"] == pytest.approx(float(torch.tensor(scores).std(unbiased=False)),
                                                                    abs=1e-5)
    assert len({round(s, 3) for s in scores}) == N  # the members differ


def test_regressors_values_are_combined_as_they_are(text_members):
    # transformers' pipeline gives a regressor's raw value (STS-B's similarity, say). A softmax over its one output
    # scored 1.0 for every text; now each member's value is transformers', the ensemble's their mean (or median, or
    # weighted mean), and the members' spread its uncertainty.
    tokenizer = text_members[1]
    models = one_logit_members("regression")
    wide = WideModel.from_models(models)
    pipe = pipeline("text-classification", model=wide, tokenizer=tokenizer)
    for text, result in zip(TEXTS, pipe(TEXTS, batch_size=2)):
        theirs = [transformers.pipeline("text-classification", model=m, tokenizer=tokenizer)(text)[0]["score"]
                  for m in models]
        values = torch.tensor(theirs)
        assert [m["score"] for m in result["members"]] == pytest.approx(theirs, abs=1e-5)
        assert result["score"] == pytest.approx(float(values.mean()), abs=1e-5)
        assert result["uncertainty"] == pytest.approx({"member_std": float(values.std(unbiased=False))}, abs=1e-5)
        median = pipeline("text-classification", model=wide, tokenizer=tokenizer, combine="median")(text)["score"]
        assert median == pytest.approx(float(values.median()), abs=1e-5)  # (three members: the middle one)
    assert pipe(TEXTS[0], function_to_apply="none") == pipe(TEXTS[0])
    assert 0 < pipe(TEXTS[0], function_to_apply="sigmoid")["score"] < 1  # asked for: probabilities
    with pytest.raises(ValueError, match="regressors' values have none"):
        pipeline("text-classification", model=wide, tokenizer=tokenizer, combine="vote")(TEXTS[0])
    tempered = pipeline("text-classification", model=wide, tokenizer=tokenizer, temperature=2.0)
    with pytest.raises(ValueError, match="temperature=2.0 scales probabilities, and these members are regressors"):
        tempered(TEXTS[0])  # a temperature was silently dropped
    sigmoids = tempered(TEXTS[0], function_to_apply="sigmoid")["members"][0]["score"]
    assert sigmoids == pytest.approx(float(torch.tensor(pipe(TEXTS[0])["members"][0]["score"] / 2).sigmoid()), abs=1e-6)


@pytest.mark.parametrize("tokenizer_pad", [None, 0], ids=["tokenizer-without-pad", "tokenizer-pad-differs"])
def test_a_decoders_classifier_is_padded_with_its_configs_pad_id(tmp_path, tokenizer_pad):
    # GPT-2's classifier scores the last token that is not config.pad_token_id. Padded with the tokenizer's id (or 0,
    # where it had none) beside a config's 1, a short text batched with a longer one was scored at a padding position.
    tokenizer = decoder_tokenizer(tmp_path)
    if tokenizer_pad is None:
        tokenizer.pad_token = None
    models = [CASES["gpt2-seqcls"].build(seed) for seed in range(N)]
    for model in models:
        model.config.pad_token_id = 1
    pipe = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
    texts = ["the cat", "the big red dog ran very fast under the green tree today"]
    for text, result in zip(texts, pipe(texts, batch_size=2)):
        with torch.no_grad():
            alone = [m(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for m in models]
        assert [m["score"] for m in result["members"]] == pytest.approx([float(p.max()) for p in alone], abs=1e-5)


def test_texts_that_no_pad_id_can_pad_are_refused_in_one_batch(tmp_path):
    tokenizer = decoder_tokenizer(tmp_path)
    tokenizer.pad_token = None
    models = [CASES["bert-seqcls"].build(seed) for seed in range(N)]
    for model in models:
        model.config.pad_token_id = None
    pipe = pipeline("text-classification", model=WideModel.from_models(models), tokenizer=tokenizer)
    texts = ["the cat", "the big red dog"]
    with pytest.raises(ValueError, match="has a pad token.*batch_size=1"):
        pipe(texts, batch_size=2)
    assert len(pipe(texts, batch_size=1)) == 2
