"""The embedded default's members: tiny ViTs trained here, together as one wide model, on scikit-learn's 8x8
handwritten digits; what ``hf-wide demo`` prints of their ensemble (:func:`run_demo`)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import metrics
from ..download import cache_home
from ..inputs import PerMember
from ..model import WideModel

DEMO_VERSION = "digits-vit-v1"
IMAGE_SIZE = 8
SPLIT_SEED = 0
# The digits are UCI's optdigits: 32x32 bitmaps whose "on" pixels were counted in 4x4 blocks. A drawing is
# brought to that shape at twice the resolution (FRAME) with strokes about as thick as the bitmaps' were.
FRAME = 64
STROKE = 4 / 32  # stroke width as a fraction of the digit's height


def default_members_dir() -> Path:
    return cache_home() / DEMO_VERSION


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
    _refuse_a_file(output)  # before the training, not after it
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
    processor = image_processor()
    paths = wide.save_members(output)  # output/member-{m}
    for path in paths:
        processor.save_pretrained(path)
    seconds = time.perf_counter() - start
    (output / "training.json").write_text(json.dumps(
        {"members": num_members, "epochs": epochs, "seconds": round(seconds, 1), "threads": torch.get_num_threads()}
    ))
    if verbose:
        print(f"Trained {num_members} members together in {seconds:.1f} s ({torch.get_num_threads()} threads).")
    return paths


def _refuse_a_file(output: Path) -> None:
    """Raise NotADirectoryError when ``output``, or the nearest of its parents that exists, is no folder."""
    existing = next(path for path in [output, *output.parents] if path.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is a file: the members are saved in a folder, member-0, member-1, ... "
                                 "inside it.")


def demo_member_paths(members_dir: str | Path | None = None, num_members: int | None = 8) -> list[Path]:
    """The cached demo members, trained on first use. ``num_members=None``: the members already in
    ``members_dir`` (``member-0``, ``member-1``, ...), however many; 8 are made if there are none."""
    members_dir = Path(members_dir) if members_dir else default_members_dir()
    _refuse_a_file(members_dir)
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
        # the folder may hold more members than are fused here (hf-wide demo --members 3 of the 8 made)
        fused = f"{len(paths)} of the {made['members']}" if len(paths) < made["members"] else f"{len(paths)}"
        print(f"Members: {fused} ViTs trained together for {made['epochs']} epochs in "
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
