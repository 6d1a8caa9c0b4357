"""The embedded default: a real deep ensemble of digit classifiers, made here from data sklearn ships.

``make_demo_members`` trains N tiny ViTs (transformers' own class) on scikit-learn's 8x8 handwritten
digits, each from its own seed on its own bootstrap sample, and saves each as an ordinary transformers
checkpoint folder with its image processor. The N members train *together*, as one wide model: wide
parameters take gradients, so one backward pass updates every member.

``run_demo`` fuses the members with ``WideModel.from_pretrained(paths)`` and prints what the ensemble
does: per-member and ensemble accuracy, calibration of the best member against the ensemble, the inputs
the members disagree on, and wide-vs-sequential timing.

``DemoEnsemble`` is what the Gradio Space (``spaces_app/``) shows for one drawing or text: the ensemble's
label, every member's vote, the uncertainty in plain words and the time of one wide forward against the
members run one after another. ``to_digit_image`` turns a drawing (dark ink on white, any size) into a
digit as the training data shows them (bright ink on black, 8x8, centred, scaled to the full height).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import metrics
from .fold import PerMember
from .model import WideModel

DEMO_VERSION = "digits-vit-v1"
IMAGE_SIZE = 8
SPLIT_SEED = 0
# The digits are UCI's optdigits: 32x32 bitmaps whose "on" pixels were counted in 4x4 blocks. A drawing is
# brought to that shape at twice the resolution (FRAME) with strokes about as thick as the bitmaps' were.
FRAME = 64
STROKE = 4 / 32  # stroke width as a fraction of the digit's height


def default_members_dir() -> Path:
    root = os.environ.get("HF_WIDE_CACHE") or Path.home() / ".cache" / "hf-wide"
    return Path(root) / DEMO_VERSION


def image_processor():
    from transformers import ViTImageProcessorPil  # the PIL backend: no torchvision needed

    # Drawn or uploaded images arrive as 0-255 pixels of any size: resize to 8x8, scale to [-1, 1].
    return ViTImageProcessorPil(
        do_resize=True, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5], image_std=[0.5],
    )


def load_digits_split():
    """Held-out split of sklearn's digits as 0-255 uint8 images (B, 8, 8) and labels, train and test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images * (255.0 / 16.0)).round().to(torch.uint8)  # (1797, 8, 8), 0..255
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=SPLIT_SEED, stratify=labels
    )
    return (x_train, y_train), (x_test, y_test)


def to_pixel_values(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 8, 8) -> float (B, 1, 8, 8), exactly what ``image_processor()`` produces for them."""
    processor = image_processor()
    return (images.float().unsqueeze(1) * processor.rescale_factor - 0.5) / 0.5


def member_config():
    from transformers import ViTConfig

    return ViTConfig(
        image_size=IMAGE_SIZE, patch_size=2, num_channels=1, hidden_size=48, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0,
        num_labels=10, id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)},
    )


def make_demo_members(output: str | Path, num_members: int = 8, seed: int = 0, epochs: int = 40,
                      batch_size: int = 64, verbose: bool = True) -> list[Path]:
    """Train ``num_members`` digit classifiers together and save each as a transformers checkpoint."""
    from transformers import ViTForImageClassification

    output = Path(output)
    (x_train, y_train), _ = load_digits_split()
    pixels = to_pixel_values(x_train)  # (n, 1, 8, 8)
    n = len(y_train)
    start = time.perf_counter()
    members = []
    for m in range(num_members):
        torch.manual_seed(seed * 1000 + m)
        members.append(ViTForImageClassification(member_config()))
    # share_identical=False: freshly initialised LayerNorms are equal in every member, and a shared
    # module would stay one tensor through training.
    wide = WideModel.from_models(
        members, member_ids=[f"digits-member-{m}" for m in range(num_members)], share_identical=False
    )
    del members
    generator = torch.Generator().manual_seed(seed)
    bootstrap = torch.randint(0, n, (num_members, n), generator=generator)  # each member's own sample
    optimizer = torch.optim.AdamW(wide.parameters(), lr=3e-3, weight_decay=0.01)
    steps = epochs * (n // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    wide.train()
    for step in range(steps):
        if step % (n // batch_size) == 0:
            order = torch.argsort(torch.rand(num_members, n, generator=generator), dim=1)
        chunk = step % (n // batch_size)
        rows = bootstrap.gather(1, order[:, chunk * batch_size : (chunk + 1) * batch_size])  # (N, b)
        logits = wide(pixel_values=PerMember(pixels[rows])).logits  # (N, b, 10)
        # Sum of the members' own mean losses: each member gets the gradient it would get alone.
        loss = F.cross_entropy(logits.flatten(0, 1), y_train[rows].flatten()) * num_members
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    wide.eval()
    paths = []
    processor = image_processor()
    for m in range(num_members):
        path = output / f"member-{m}"
        wide.member(m).save_pretrained(path)
        processor.save_pretrained(path)
        paths.append(path)
    seconds = time.perf_counter() - start
    (output / "training.json").write_text(json.dumps(
        {"members": num_members, "epochs": epochs, "seconds": round(seconds, 1), "threads": torch.get_num_threads()}
    ))
    if verbose:
        print(f"Trained {num_members} members together in {seconds:.1f} s ({torch.get_num_threads()} threads).")
    return paths


def demo_member_paths(members_dir: str | Path | None = None, num_members: int | None = 8) -> list[Path]:
    """The cached demo members, trained on first use. ``num_members=None``: the members already in
    ``members_dir`` (``member-0``, ``member-1``, ...), however many; 8 are made if there are none."""
    members_dir = Path(members_dir) if members_dir else default_members_dir()
    if num_members is None:
        num_members = sum(1 for _ in members_dir.glob("member-*/model.safetensors")) or 8
    paths = [members_dir / f"member-{m}" for m in range(num_members)]
    if not all((p / "model.safetensors").exists() for p in paths):
        print(f"Making the embedded default ensemble in {members_dir} (once) ...")
        paths = make_demo_members(members_dir, num_members)
    return paths


@torch.inference_mode()
def evaluate(wide: WideModel, pixels: torch.Tensor, labels: torch.Tensor) -> dict:
    """Accuracy and calibration of every member and of the ensemble (mean of probabilities)."""
    member_probs = wide(pixel_values=pixels).logits.softmax(-1)  # (N, B, 10)
    ensemble = member_probs.mean(0)
    return {
        "members": [_scores(p, labels) for p in member_probs],
        "ensemble": _scores(ensemble, labels),
        "agreement": metrics.vote_agreement(member_probs).mean().item(),
        "mutual_information": metrics.mutual_information(member_probs),
        "member_probs": member_probs,
    }


def _scores(probs: torch.Tensor, labels: torch.Tensor) -> dict:
    """Accuracy, NLL, ECE and mean confidence of probabilities (B, C) against labels (B,)."""
    confidence, predicted = probs.max(-1)
    return {"accuracy": (predicted == labels).float().mean().item(), "nll": metrics.nll(probs, labels).item(),
            "ece": metrics.expected_calibration_error(probs, labels).item(),
            "confidence": confidence.mean().item()}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def time_wide_vs_sequential(wide: WideModel, inputs: torch.Tensor | dict, members=None,
                            repeats: int = 7) -> tuple[float, float]:
    """Median seconds of one wide forward and of the N members run one after another on ``inputs``
    (``pixel_values`` or a dict of model inputs), interleaved so that both meet the same machine load.
    ``members``: the members as ordinary models; by default views into the wide model's tensors
    (``member(i, share=True)``), which cost no memory."""
    inputs = {"pixel_values": inputs} if isinstance(inputs, torch.Tensor) else inputs
    members = members or [wide.member(i, share=True).eval() for i in range(wide.num_members)]

    def run_wide():
        wide(**inputs)

    def run_sequential():
        for member in members:
            member(**inputs)

    run_wide(), run_sequential()  # warm-up
    times = [(_seconds(run_wide), _seconds(run_sequential)) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def calibration_rows(report: dict) -> list[tuple[str, dict]]:
    """(name, {accuracy, nll, ece, confidence}) for the best member (lowest NLL), the mean member and the ensemble."""
    members = report["members"]
    best = min(range(len(members)), key=lambda i: members[i]["nll"])
    mean = {k: statistics.mean(m[k] for m in members) for k in members[0]}
    return [(f"best member ({best})", members[best]), ("mean member", mean), ("ensemble", report["ensemble"])]


def run_demo(members_dir: str | Path | None = None, num_members: int = 8) -> dict:
    paths = demo_member_paths(members_dir, num_members)
    training = paths[0].parent / "training.json"
    if training.exists():
        made = json.loads(training.read_text())
        print(f"Members: {made['members']} ViTs trained together for {made['epochs']} epochs in "
              f"{made['seconds']} s ({made['threads']} threads), cached in {paths[0].parent}")
    wide = WideModel.from_pretrained([str(p) for p in paths])
    print(wide.plan.summary())
    _, (x_test, y_test) = load_digits_split()
    pixels = to_pixel_values(x_test)
    report = evaluate(wide, pixels, y_test)
    print(f"\nHeld-out digits: {len(y_test)} images, {wide.num_members} members fused into one model\n")
    print(f"{'model':<18}{'accuracy':>10}{'NLL':>8}{'ECE':>8}{'confidence':>12}")
    rows = [(f"member {i}", r) for i, r in enumerate(report["members"])]
    for name, r in rows + [("", None)] + calibration_rows(report):
        print(f"{name:<18}{r['accuracy']:>10.3f}{r['nll']:>8.3f}{r['ece']:>8.3f}{r['confidence']:>12.3f}" if r else "")
    (best_name, best), (_, mean), (_, e) = calibration_rows(report)
    side = "under" if e["confidence"] < e["accuracy"] else "over"
    print(f"\nNLL: ensemble {e['nll']:.3f}, mean member {mean['nll']:.3f}, {best_name} {best['nll']:.3f}. "
          f"ECE: ensemble {e['ece']:.3f}, {best_name} {best['ece']:.3f}\n(the ensemble is {side}-confident: "
          f"mean confidence {e['confidence']:.3f} for accuracy {e['accuracy']:.3f}). "
          f"Members agree with the ensemble on {report['agreement']:.1%} of votes.")
    most_uncertain = report["mutual_information"].argsort(descending=True)[:3].tolist()
    for idx in most_uncertain:
        votes = report["member_probs"][:, idx].argmax(-1).tolist()
        print(f"  image {idx} (true {y_test[idx].item()}): member votes {votes}, "
              f"mutual information {report['mutual_information'][idx]:.3f}")
    wide_s, sequential_s = time_wide_vs_sequential(wide, pixels[:32])
    print(f"\nOne batch of 32 images: wide {wide_s * 1e3:.2f} ms vs {wide.num_members} members in sequence "
          f"{sequential_s * 1e3:.2f} ms ({sequential_s / wide_s:.1f}x), {torch.get_num_threads()} threads.")
    return report


# ---------------------------------------------------------------- drawings and examples
def to_digit_image(image):
    """A drawing, photo or scan of one digit as the training data shows digits: an 8x8 ``L`` image with
    bright ink on black, the digit centred and scaled to fill the height, strokes as thick as the data's.

    ``image``: a PIL image (any mode and size), an array or a path. Dark ink on a light ground (a
    sketchpad, paper) is inverted; which is ink is read from the border. Raises ValueError when blank."""
    from PIL import Image, ImageFilter

    from .pipelines.inputs import load_image

    gray = np.asarray(load_image(image, 1), dtype=np.float32)  # (H, W), 0..255; transparency on white
    border = np.concatenate([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    if np.median(border) > 127:  # a light ground: dark ink
        gray, border = 255 - gray, 255 - border
    ink = np.clip(gray - np.median(border), 0, None)
    if ink.max() < 32:
        raise ValueError("The image is blank: draw or upload a digit.")
    mask = ink > 0.1 * ink.max()
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    ink = ink[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]  # cropped to the digit
    scale = FRAME / max(ink.shape)
    size = (max(1, round(ink.shape[1] * scale)), max(1, round(ink.shape[0] * scale)))  # (w, h)
    digit = Image.fromarray(ink * (255 / ink.max())).convert("L").resize(size, Image.BOX)
    # Stroke width from the ink's area and outline (a stroke of width w and length L: area wL, outline 2L).
    on = np.asarray(digit) > 64
    inner = np.asarray(Image.fromarray(on.astype(np.uint8) * 255).filter(ImageFilter.MinFilter(3))) > 0
    width = 2 * on.sum() / max((on & ~inner).sum(), 1)
    grow = round(STROKE * FRAME - width)
    if grow >= 1:
        digit = digit.filter(ImageFilter.MaxFilter(2 * ((grow + 1) // 2) + 1))
    canvas = Image.new("L", (FRAME, FRAME))
    canvas.paste(digit, ((FRAME - size[0]) // 2, (FRAME - size[1]) // 2))
    small = np.asarray(canvas.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BOX), dtype=np.float32)  # block means
    return Image.fromarray(np.round(small * (255 / max(small.max(), 1))).astype(np.uint8), mode="L")


def digit_drawing(image: torch.Tensor, size: int = 160):
    """A dataset digit (8, 8) uint8 as a person would draw it: dark ink on white, ``size`` pixels wide."""
    from PIL import Image

    return Image.fromarray(255 - image.numpy()).resize((size, size), Image.BICUBIC)


def example_digits(wide: WideModel, folder: str | Path, clear: int = 4, ambiguous: int = 4) -> list[tuple[Path, str]]:
    """Held-out digits saved as drawings (PNG) in ``folder``, with a caption each: ``clear`` ones the
    members agree on (distinct labels) and the ``ambiguous`` ones they disagree on most (highest mutual
    information)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, (x_test, y_test) = load_digits_split()
    drawings = [digit_drawing(x) for x in x_test]
    # Chosen on what the members will see of the drawings, not on the dataset's own pixels.
    seen = torch.tensor(np.stack([np.asarray(to_digit_image(d)) for d in drawings]))  # (B, 8, 8) uint8
    report = evaluate(wide, to_pixel_values(seen), y_test)
    information = report["mutual_information"]
    correct = report["member_probs"].mean(0).argmax(-1) == y_test
    chosen, labels = [], set()
    for i in information.argsort().tolist():  # most certain first
        if correct[i] and y_test[i].item() not in labels and len(labels) < clear:
            labels.add(y_test[i].item())
            chosen.append((i, f"a clear {y_test[i].item()}"))
    for i in information.argsort(descending=True)[:ambiguous].tolist():
        chosen.append((i, f"ambiguous (written as {y_test[i].item()})"))
    examples = []
    for i, caption in chosen:
        path = folder / f"digit-{i}.png"
        drawings[i].save(path)
        examples.append((path, caption))
    return examples


# ---------------------------------------------------------------- what the Space shows
def task_for_config(config) -> str:
    """The pipeline task of a classifier's config: ``image-classification`` or ``text-classification``."""
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture.endswith("ForImageClassification"):
            return "image-classification"
        if architecture.endswith("ForSequenceClassification"):
            return "text-classification"
    raise ValueError(f"The demo shows image or text classifiers; this model is {architectures or 'unknown'}.")


def is_digit_model(config) -> bool:
    """True for models that read digits as the embedded default does: one channel, 8x8."""
    return getattr(config, "num_channels", None) == 1 and getattr(config, "image_size", None) == IMAGE_SIZE


class DemoEnsemble:
    """A classification pipeline with what the Space shows beside its answer.

    ``DemoEnsemble.load(model_id)`` loads a fused repo (or comma-separated member ids) and falls back to the
    embedded default, with a note saying why, when it cannot. ``classify(item)`` returns the pipeline's
    result plus ``summary`` (the uncertainty in plain words), ``timing`` (one wide forward against the
    members one after another) and ``seen`` (the digit as the members see it, for digit models)."""

    def __init__(self, pipe, source: str, note: str = ""):
        self.pipe, self.source, self.note = pipe, source, note
        self.task = pipe.task
        self.digits = self.task == "image-classification" and is_digit_model(pipe.model.config)
        self.members = [pipe.model.member(i, share=True).eval() for i in range(pipe.model.num_members)]

    @property
    def num_members(self) -> int:
        return self.pipe.model.num_members

    @classmethod
    def load(cls, model_id: str | None = None, members_dir: str | Path | None = None) -> DemoEnsemble:
        """``model_id``: a fused Hub repo, or member ids separated by commas; None: the embedded default
        (the members in ``members_dir``, or the cached eight, made once)."""
        from transformers import AutoConfig

        from .pipelines import pipeline

        note = ""
        if model_id:
            ids = [part.strip() for part in model_id.split(",") if part.strip()]
            try:
                task = task_for_config(AutoConfig.from_pretrained(ids[0]))
                return cls(pipeline(task, model=ids[0] if len(ids) == 1 else ids), source=", ".join(ids))
            except Exception as exc:  # unreachable Hub, unknown repo, unsupported model: say so, go on
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                note = f"Could not use {model_id} ({reason}); showing the embedded default instead."
        paths = demo_member_paths(members_dir, None if members_dir else 8)
        return cls(pipeline("image-classification", model=[str(p) for p in paths]),
                   source="the embedded default (digit classifiers trained here)", note=note)

    def held_out_report(self) -> list[tuple[str, dict]] | None:
        """Accuracy, NLL and ECE on the held-out digits of every member, the best, the mean member and the
        ensemble (digit models only)."""
        if not self.digits:
            return None
        _, (x_test, y_test) = load_digits_split()
        report = evaluate(self.pipe.model, to_pixel_values(x_test), y_test)
        return [(f"member {i}", r) for i, r in enumerate(report["members"])] + calibration_rows(report)

    def classify(self, item, top_k: int = 3) -> dict:
        """``item``: an image (PIL, array, path) or a text, by the task. Raises ValueError on a blank or
        empty input."""
        seen = to_digit_image(item) if self.digits else None
        item = seen if seen is not None else item
        result = self.pipe(item, top_k=top_k)
        inputs = self.pipe.preprocess(item)  # the same tensors the pipeline ran: (1, ...)
        wide_s, sequential_s = time_wide_vs_sequential(self.pipe.model, inputs, self.members, repeats=15)
        result["timing"] = {"wide_ms": wide_s * 1e3, "sequential_ms": sequential_s * 1e3}
        result["summary"] = describe_uncertainty(result)
        result["seen"] = seen
        return result


def describe_uncertainty(result: dict) -> str:
    """The ensemble's answer and how far to trust it, in words a non-specialist reads."""
    votes = [m["label"] for m in result["members"]]
    n, label = len(votes), result["label"]
    agreeing = votes.count(label)
    others = sorted({v for v in votes if v != label}, key=lambda v: (-votes.count(v), v))
    u = result["uncertainty"]
    if agreeing == n:
        head = f"All {n} members say {label}."
    else:
        rest = ", ".join(f"{v} ({votes.count(v)})" for v in others)
        head = f"{agreeing} of {n} members say {label}; the others say {rest}."
    # Thresholds in nats: on the held-out digits about one input in ten is above each.
    if u["mutual_information"] > 0.2:
        verdict = ("The members disagree: this input is unusual, unlike the examples they learned from. "
                   "Treat the answer with caution.")
    elif u["predictive_entropy"] > 0.5:
        verdict = ("None of the members is sure, and they are unsure alike: the input looks like more than "
                   "one class to all of them.")
    else:
        verdict = "The members agree and are confident: this looks like what they were trained on."
    numbers = (f"Total uncertainty (entropy): {u['predictive_entropy']:.2f} nats, of which disagreement "
               f"between members (mutual information): {u['mutual_information']:.2f}; "
               f"agreement {agreeing}/{n}.")
    return f"{head} {verdict}\n\n{numbers}"
