"""The hf-wide Space: draw a digit (or type a text) and watch N fused classifiers vote in one forward pass.

Front end only: it reads the person's input and calls hf-wide's public API (``hf_wide.demo.DemoEnsemble``,
which runs ``hf_wide.pipeline``); no model logic lives here. Settings come from the environment:

    HF_WIDE_MODEL              a fused Hub repo id (or member ids, comma-separated); unset, unreachable or
                               unsupported: the embedded default, with a note saying why
    HF_WIDE_DEMO_MEMBERS_DIR   the embedded default's members (made there once when missing)
    GRADIO_SERVER_NAME, GRADIO_SERVER_PORT   where to serve, as for any Gradio app

Run it with ``python spaces_app/app.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # nothing leaves the machine at launch

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402

try:
    from hf_wide.demo import DemoEnsemble, example_digits
except ImportError:  # a checkout without hf-wide installed: the package lies beside spaces_app/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hf_wide.demo import DemoEnsemble, example_digits

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D",
           "#79706E"]
TEXT_EXAMPLES = ["What a wonderful, moving film.", "The service was slow and the food was cold.",
                 "It was fine, I guess."]
# Gradio's sketchpad opens, and clears, with no tool chosen: pick the brush, so that a person draws at once.
PICK_BRUSH = """() => {
  const pick = (tries) => {
    const brush = document.querySelector("#drawing button[aria-label='Brush']");
    if (brush) brush.click(); else if (tries > 0) setTimeout(() => pick(tries - 1), 250);
  };
  pick(40);
  document.addEventListener("click", (event) => {
    if (event.target.closest("#drawing button[aria-label='Clear canvas']")) setTimeout(() => pick(4), 300);
  }, true);  // capture: the editor's own handler stops the click from bubbling
}"""
CSS = """
#seen img { image-rendering: pixelated; }
#verdict { font-size: 1.05rem; }
"""


def _outputs(result: dict, labels: list[str]) -> tuple:
    """The pipeline's result as the values of (label, votes, verdict, timing, seen, raw)."""
    members = result["members"]
    # One row per member and label, zero but for its vote: the chart's colour domain (every label) then
    # stays the same from one input to the next, which Gradio's plot needs to redraw.
    votes = pd.DataFrame([
        {"member": f"member {i + 1}", "vote": label, "probability": m["score"] if m["label"] == label else 0.0}
        for i, m in enumerate(members) for label in labels
    ])
    n = len(members)
    t = result["timing"]
    timing = (f"**One wide forward** for all {n} members: **{t['wide_ms']:.1f} ms** · "
              f"the {n} members **one after another**: {t['sequential_ms']:.1f} ms "
              f"({t['sequential_ms'] / t['wide_ms']:.1f}x the time)")
    seen = result["seen"].resize((128, 128), 0) if result["seen"] is not None else None  # 0: nearest
    raw = {k: v for k, v in result.items() if k != "seen"}
    return {e["label"]: e["score"] for e in result["top_k"]}, votes, result["summary"], timing, seen, raw


def _nothing(message: str) -> tuple:
    return None, None, message, "", None, None


def _classify(ensemble: DemoEnsemble):
    labels, _ = ensemble.pipe.label_order()

    def classify(item):
        """Classify an image or a text: the ensemble's label, every member's vote, the uncertainty."""
        if item is None or (isinstance(item, str) and not item.strip()):
            return _nothing("Give the ensemble something to classify.")
        try:
            return _outputs(ensemble.classify(item), labels)
        except (TypeError, ValueError) as exc:  # a blank image, an over-long text
            return _nothing(str(exc))
    return classify


def _classify_drawing(ensemble: DemoEnsemble):
    classify = _classify(ensemble)

    def classify_drawing(drawing):
        """Classify a drawing (the sketchpad's value: background, layers and their composite)."""
        image = None if drawing is None else drawing["composite"] or drawing["background"]
        if image is None:
            return _nothing("Draw a digit, upload an image or click an example.")
        return classify(image)
    return classify_drawing


def _result_panel(ensemble: DemoEnsemble, labels: list[str]) -> list:
    label = gr.Label(num_top_classes=3, label="The ensemble says", elem_id="label")
    verdict = gr.Markdown(elem_id="verdict")
    votes = gr.BarPlot(
        x="member", y="probability", color="vote", y_lim=[0, 1], elem_id="votes",
        title="Every member's vote (bar height: how sure it is)", x_title="", y_title="probability of its vote",
        sort=[f"member {i + 1}" for i in range(ensemble.num_members)],
        color_map={lab: PALETTE[i % len(PALETTE)] for i, lab in enumerate(labels)},
    )
    timing = gr.Markdown(elem_id="timing")
    seen = gr.Image(label="What the members see (8x8)", type="pil", height=150, interactive=False,
                    elem_id="seen", visible=ensemble.digits, buttons=[])
    with gr.Accordion("The whole result (JSON, as the API returns it)", open=False):
        raw = gr.JSON(elem_id="raw")
    return [label, votes, verdict, timing, seen, raw]


def _about(ensemble: DemoEnsemble) -> str:
    text = (f"**hf-wide** folds the {ensemble.num_members} members into one wide model: their weights are "
            "stacked, and one forward pass computes every member's answer, equal to each member run alone. "
            "The ensemble averages the members' probabilities; where they disagree (high *mutual "
            "information*), the input is unlike what they learned from.")
    rows = ensemble.held_out_report()
    if rows:
        table = "\n".join(f"| {name} | {r['accuracy']:.3f} | {r['nll']:.3f} | {r['ece']:.3f} | {r['confidence']:.3f} |"
                          for name, r in rows)
        text += ("\n\nOn the held-out digits (NLL: how surprised by the truth; ECE: the gap between confidence "
                 "and accuracy; lower is better for both):\n\n"
                 "| model | accuracy | NLL | ECE | mean confidence |\n|---|---|---|---|---|\n" + table)
    return text


def _image_tab(ensemble: DemoEnsemble, labels: list[str], examples_dir: str | Path | None) -> None:
    classify_drawing, classify = _classify_drawing(ensemble), _classify(ensemble)
    with gr.Tab("Draw a digit" if ensemble.digits else "Classify an image"), gr.Row():
        with gr.Column():
            drawing = gr.Sketchpad(
                label="Draw a digit", type="pil", image_mode="RGB", canvas_size=(320, 320), fixed_canvas=True,
                layers=False, transforms=(), brush=gr.Brush(default_size=22, colors=["#000000"], color_mode="fixed"),
                eraser=gr.Eraser(default_size=22), elem_id="drawing",
            )
            button = gr.Button("Classify the drawing", variant="primary", elem_id="classify-drawing")
            # RGBA: Gradio's default (RGB) drops the alpha, and black ink on a transparent ground would come as
            # black on black; the sketchpad above flattens its own transparency on white.
            upload = gr.Image(label="... or upload an image", type="pil", image_mode="RGBA",
                              sources=("upload", "clipboard"), height=160, elem_id="upload")
            examples_slot = gr.Column()  # filled below, once the outputs exist
        with gr.Column():
            outputs = _result_panel(ensemble, labels)
        # Events first: the examples' own event would otherwise take the function's name as its API name.
        button.click(classify_drawing, drawing, outputs, api_name="classify_drawing")
        upload.upload(classify, upload, outputs, api_name="classify_image")
        if ensemble.digits:
            examples = example_digits(ensemble.pipe.model, examples_dir or tempfile.mkdtemp(prefix="hf-wide-"))
            with examples_slot:
                gr.Examples([[str(path)] for path, _ in examples], inputs=drawing, outputs=outputs,
                            fn=classify_drawing, run_on_click=True, cache_examples=False, api_visibility="private",
                            example_labels=[caption for _, caption in examples], label="Examples: click one")


def _text_tab(ensemble: DemoEnsemble, labels: list[str]) -> None:
    classify = _classify(ensemble)
    with gr.Tab("Classify a text"), gr.Row():
        with gr.Column():
            text = gr.Textbox(label="Text", lines=3, elem_id="text")
            button = gr.Button("Classify", variant="primary", elem_id="classify-text")
            examples_slot = gr.Column()
        with gr.Column():
            outputs = _result_panel(ensemble, labels)
        button.click(classify, text, outputs, api_name="classify_text")
        text.submit(classify, text, outputs, api_visibility="private")
        with examples_slot:
            gr.Examples([[t] for t in TEXT_EXAMPLES], inputs=text, outputs=outputs, fn=classify, run_on_click=True,
                        cache_examples=False, api_visibility="private", label="Examples: click one")


def build_demo(ensemble: DemoEnsemble, examples_dir: str | Path | None = None) -> gr.Blocks:
    """The Space's page for ``ensemble``: a drawing tab for an image classifier, a text tab for a text one."""
    labels, _ = ensemble.pipe.label_order()
    with gr.Blocks(title="hf-wide: an ensemble in one forward pass") as demo:
        gr.Markdown(f"# hf-wide: {ensemble.num_members} classifiers, one forward pass\n"
                    f"A deep ensemble of {ensemble.num_members} models fused into one wide model. "
                    f"Model: {ensemble.source}.")
        if ensemble.note:
            gr.Markdown(f"⚠️ {ensemble.note}", elem_id="note")
        if ensemble.task == "text-classification":
            _text_tab(ensemble, labels)
        else:
            _image_tab(ensemble, labels, examples_dir)
        with gr.Tab("About"):
            gr.Markdown(_about(ensemble))
    return demo


def main() -> None:
    ensemble = DemoEnsemble.load(os.environ.get("HF_WIDE_MODEL"), os.environ.get("HF_WIDE_DEMO_MEMBERS_DIR"))
    build_demo(ensemble).launch(theme=gr.themes.Default(primary_hue="indigo"), css=CSS, js=PICK_BRUSH)


if __name__ == "__main__":
    main()
