"""The Gradio Space (spaces_app/app.py): started as a real server on 127.0.0.1, driven in headless Chromium
with Playwright, and called through its API with gradio_client. Its members are a tiny, fast ensemble."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

from hf_wide.demo import DemoEnsemble, make_demo_members

pytest.importorskip("gradio", reason="the Space needs gradio (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "spaces_app" / "app.py"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
NUM_MEMBERS = 3


@pytest.fixture(scope="module")
def members_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("space-members")
    make_demo_members(root, num_members=NUM_MEMBERS, epochs=2, verbose=False)
    return root


@pytest.fixture(scope="module")
def space_url(members_dir, tmp_path_factory):
    """The app started as a Space starts it, ``python app.py``, on a free port; stopped afterwards."""
    port = free_port()
    log = tmp_path_factory.mktemp("space-log") / "app.log"
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_WIDE_DEMO_MEMBERS_DIR": str(members_dir), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_WIDE_MODEL", None)
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(APP)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"the app exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the app did not answer within 120 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _bars_drawn(n: int) -> str:
    """JS: true once the vote chart shows a non-zero bar for each of the n members."""
    return (f"() => Array.from(document.querySelectorAll('#votes svg g.mark-rect path'))"
            f".filter(p => /probability of its vote: (?!0;)/.test(p.getAttribute('aria-label') || '')).length == {n}")


def test_browser_click_example_and_draw(space_url, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make test installs it: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (dev extra)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(space_url)
            page.wait_for_selector("#drawing canvas", timeout=60_000)
            page.get_by_text("ambiguous", exact=False).first.click()  # an example: loads it and classifies it
            page.wait_for_function(_bars_drawn(NUM_MEMBERS), timeout=60_000)
            label = page.inner_text("#label")
            assert re.search(r"^\d$", label, re.MULTILINE), label
            assert re.search(rf"(All {NUM_MEMBERS} members say \d|\d of {NUM_MEMBERS} members say \d)",
                             page.inner_text("#verdict"))
            assert "mutual information" in page.inner_text("#verdict")
            assert "One wide forward" in page.inner_text("#timing")
            screenshot = tmp_path / "space.png"
            page.screenshot(path=str(screenshot), full_page=True)
            (ROOT / "artifacts").mkdir(exist_ok=True)
            shutil.copy(screenshot, ROOT / "artifacts" / "space.png")  # for the record (ignored by git)

            # Draw a stroke by hand on a cleared canvas: the brush is picked for the person.
            page.locator("#drawing button[aria-label='Clear canvas']").click()
            page.wait_for_function("() => !document.querySelector('#drawing').innerText.includes('draw tool')",
                                   timeout=10_000)
            before = page.inner_text("#timing")
            box = page.locator("#drawing canvas").first.bounding_box()
            x = box["x"] + box["width"] / 2
            page.mouse.move(x, box["y"] + box["height"] * 0.2)
            page.mouse.down()
            page.mouse.move(x, box["y"] + box["height"] * 0.8, steps=15)
            page.mouse.up()
            page.click("#classify-drawing")
            page.wait_for_function(f"() => document.querySelector('#timing').innerText !== {before!r}",
                                   timeout=60_000)
            assert "members say" in page.inner_text("#verdict")
        finally:
            browser.close()


def test_gradio_client_calls_the_api(space_url, members_dir):
    from gradio_client import Client, handle_file

    client = Client(space_url, verbose=False)
    assert {"/classify_drawing", "/classify_image"} <= set(client.view_api(print_info=False, return_format="dict")
                                                            ["named_endpoints"])
    image = _digit_png(members_dir)
    label, votes, verdict, timing, seen, raw = client.predict(handle_file(str(image)), api_name="/classify_image")
    assert label["label"] == raw["label"] and len(label["confidences"]) == 3
    assert votes["columns"] == ["member", "vote", "probability"] and len(votes["data"]) == NUM_MEMBERS * 10
    assert f"of {NUM_MEMBERS} members" in verdict or f"All {NUM_MEMBERS} members" in verdict
    assert "One wide forward" in timing and Path(seen).exists()
    assert len(raw["members"]) == NUM_MEMBERS
    assert set(raw["uncertainty"]) == {"predictive_entropy", "expected_entropy", "mutual_information",
                                       "member_std", "agreement"}
    assert raw["timing"]["wide_ms"] > 0 and raw["timing"]["sequential_ms"] > 0

    drawn = {"background": None, "layers": [], "composite": handle_file(str(image))}
    assert client.predict(drawn, api_name="/classify_drawing")[0]["label"] == label["label"]


def _digit_png(members_dir: Path) -> Path:
    from hf_wide.demo import digit_drawing, load_digits_split

    path = members_dir / "digit.png"
    if not path.exists():
        _, (x_test, _) = load_digits_split()
        digit_drawing(x_test[0]).save(path)
    return path


# ---------------------------------------------------------------- the app's logic without a server
def _load_app():
    spec = importlib.util.spec_from_file_location("hf_wide_space_app", APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_id, reason", [
    ("/no/such/fused-model", "Could not use /no/such/fused-model"),  # neither a folder nor a repo id
    ("causal-lm", "this model is ['GPT2LMHeadModel']"),  # loads, but the Space shows classifiers only
    # a KeyError ('mutual_information') from the verdict, and "list indices must be integers or slices, not str"
    ("regression", "this model is a regressor (problem_type='regression')"),
    ("multi_label_classification", "a multi-label classifier (problem_type='multi_label_classification')"),
])
def test_a_model_that_cannot_be_shown_falls_back_to_the_embedded_default(members_dir, tmp_path, model_id, reason):
    from transformers import BertConfig, GPT2Config

    if model_id == "causal-lm":
        GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
        model_id = str(tmp_path)
    elif model_id != "/no/such/fused-model":  # (its config alone: the Space reads it before any weights)
        BertConfig(architectures=["BertForSequenceClassification"], problem_type=model_id).save_pretrained(tmp_path)
        model_id = f"{tmp_path},{tmp_path}"
    ensemble = DemoEnsemble.load(model_id, members_dir)
    assert ensemble.task == "image-classification" and ensemble.num_members == NUM_MEMBERS
    assert reason in ensemble.note and ensemble.note.endswith("showing the embedded default instead.")


@pytest.mark.parametrize("model_id", [" ", ",", " , "])
def test_a_blank_model_setting_is_no_setting(members_dir, model_id):
    # the note was "Could not use   (list index out of range)"
    ensemble = DemoEnsemble.load(model_id, members_dir)
    assert ensemble.source.startswith("the embedded default") and ensemble.note == ""


def test_the_reason_a_model_cannot_be_shown_is_kept_whole(members_dir, text_members, tmp_path):
    # cut at 200 characters: "... has {0: 'negative', 1: 'positive'}. Pass allo); showing the embedded default"
    import shutil

    other = shutil.copytree(text_members[1], tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "positive", "1": "negative"}, {"positive": 0, "negative": 1}
    (other / "config.json").write_text(json.dumps(config))
    ensemble = DemoEnsemble.load(f"{text_members[0]},{other}", members_dir)
    assert len(ensemble.note) > 250
    assert ensemble.note.endswith("Pass allow_label_mismatch=True to fuse members whose labels differ.); showing the "
                                  "embedded default instead.")


def test_an_uploaded_digit_in_black_ink_on_a_transparent_ground(members_dir, tmp_path):
    # Gradio's default image_mode ("RGB") dropped the alpha: black ink on black, "The image is blank"
    import numpy as np
    from gradio.data_classes import FileData
    from PIL import Image

    from hf_wide.demo import digit_drawing, load_digits_split

    app = _load_app()
    ensemble = DemoEnsemble.load(None, members_dir)
    demo = app.build_demo(ensemble, examples_dir=tmp_path / "examples")
    (upload,) = [block for block in demo.blocks.values() if getattr(block, "elem_id", None) == "upload"]
    _, (x_test, _) = load_digits_split()
    drawn = digit_drawing(x_test[0])  # dark ink on white
    ink = np.zeros((*drawn.size[::-1], 4), dtype=np.uint8)
    ink[..., 3] = 255 - np.asarray(drawn)  # black, as opaque as the drawing is dark
    Image.fromarray(ink, mode="RGBA").save(tmp_path / "ink.png")
    image = upload.preprocess(FileData(path=str(tmp_path / "ink.png"), orig_name="ink.png"))
    _, _, verdict, _, _, raw = app._classify(ensemble)(image)
    assert raw is not None, verdict
    assert raw["label"] == app._classify(ensemble)(drawn)[5]["label"]


def test_a_fused_repo_on_the_hub_is_what_the_space_shows(members_dir, tmp_path):
    from hub_server import TOKEN, running_hub

    from hf_wide import WideModel

    with running_hub(tmp_path):
        WideModel.from_pretrained(sorted(str(p) for p in members_dir.glob("member-*"))).push_to_hub(
            "alice/digits-wide", token=TOKEN)
        ensemble = DemoEnsemble.load("alice/digits-wide", members_dir)
    assert not ensemble.note and ensemble.source == "alice/digits-wide"
    assert ensemble.digits and ensemble.num_members == NUM_MEMBERS
    assert ensemble.classify(_digit_png(members_dir))["label"] in [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def text_members(tmp_path_factory):
    """Two tiny BERT sentiment classifiers with a word-level vocabulary, saved as checkpoint folders."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    root = tmp_path_factory.mktemp("text-members")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film"]))
    tokenizer = BertTokenizer(str(root / "vocab.txt"), model_max_length=32)
    config = BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2,
                        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    paths = []
    for seed in range(2):
        torch.manual_seed(seed)
        path = root / f"member-{seed}"
        BertForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def test_the_app_adapts_to_a_text_classifier(text_members):
    app = _load_app()
    ensemble = DemoEnsemble.load(",".join(text_members))
    assert ensemble.task == "text-classification" and not ensemble.note
    demo = app.build_demo(ensemble)
    tabs = [block.label for block in demo.blocks.values() if type(block).__name__ == "Tab"]
    assert tabs == ["Classify a text", "About"]
    label, votes, verdict, timing, seen, raw = app._classify(ensemble)("a good film")
    assert set(label) <= {"negative", "positive"} and seen is None
    assert "of 2 members" in verdict or "All 2 members" in verdict
    assert app._classify(ensemble)("   ")[2] == "Give the ensemble something to classify."


def test_a_blank_drawing_asks_for_a_digit(members_dir):
    from PIL import Image

    app = _load_app()
    ensemble = DemoEnsemble.load(None, members_dir)
    blank = Image.new("RGB", (320, 320), "white")
    assert "blank" in app._classify_drawing(ensemble)({"background": None, "layers": [], "composite": blank})[2]
    assert app._classify_drawing(ensemble)(None)[2].startswith("Draw a digit")


def test_the_space_folder_is_deployable_as_it_is():
    import tomllib

    import yaml

    front = yaml.safe_load((ROOT / "spaces_app" / "README.md").read_text().split("---")[1])
    assert front["sdk"] == "gradio" and front["app_file"] == "app.py" and front["models"]
    assert int(str(front["sdk_version"]).split(".")[0]) >= 6
    required = {re.split(r"[<>=\[ ]", line)[0].lower().replace("_", "-")
                for line in (ROOT / "spaces_app" / "requirements.txt").read_text().splitlines()
                if line and not line.startswith(("#", "-"))}
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {re.split(r"[<>=\[ ]", dep)[0].lower().replace("_", "-") for dep in package} <= required
