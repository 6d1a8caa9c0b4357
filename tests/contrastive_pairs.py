"""Contrastive pairs of encoders for tests: tiny CLIP and SigLIP models, texts and images in numbers of their own, and
the oracle over their outputs (each member's against its model run alone)."""

import peft
import torch
import transformers as tf

from hf_wide.adapters import peft_quietly
from hf_wide.rewrites import WideCLIPModel, WideSiglipModel

TOWERS = dict(text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "max_position_embeddings": 16},
              vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "intermediate_size": 64, "image_size": 16, "patch_size": 4})
PAIRS = {  # a contrastive pair of encoders: (model class, config class, rewrite)
    "clip": (tf.CLIPModel, lambda: tf.CLIPConfig(projection_dim=16, **TOWERS), WideCLIPModel),
    "siglip": (tf.SiglipModel, lambda: tf.SiglipConfig(**TOWERS), WideSiglipModel),
}


def pair(name: str, seed: int) -> torch.nn.Module:
    model_class, config, _ = PAIRS[name]
    torch.manual_seed(seed)
    return model_class(config()).eval()


def texts_and_images(texts: int, images: int, seed: int = 5) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(5, 64, (texts, 7), generator=gen),
            "pixel_values": torch.randn(images, 3, 16, 16, generator=gen)}


PAIR_OUTPUTS = ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")


def pair_error(wide, references, inputs: dict, outputs=PAIR_OUTPUTS) -> float:
    with torch.no_grad():
        got = wide(**inputs)
        wanted = [reference(**inputs) for reference in references]
    assert all(got[key].shape == (len(references), *wanted[0][key].shape) for key in outputs)
    return max((got[key][i] - want[key]).abs().max().item() for key in outputs for i, want in enumerate(wanted))


def pair_adapters(name: str, root, ranks) -> list[str]:
    """A base of ``name`` saved at ``root / "base"`` and a LoRA adapter of it per rank (on q, v and the first MLP
    linear of both towers, A and B random from its index), saved beside it: their folders."""
    model_class = PAIRS[name][0]
    pair(name, 0).save_pretrained(root / "base")
    adapters = []
    for seed, r in enumerate(ranks):
        torch.manual_seed(seed)
        with peft_quietly():
            model = peft.get_peft_model(model_class.from_pretrained(root / "base"), peft.LoraConfig(
                r=r, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "fc1"]))
        model.save_pretrained(root / f"a{seed}")
        adapters.append(str(root / f"a{seed}"))
    return adapters


def adapter_alone(name: str, root, adapter: str) -> torch.nn.Module:
    """The oracle's reference: ``PeftModel.from_pretrained(base, adapter)`` over the base at ``root / "base"``."""
    return peft.PeftModel.from_pretrained(PAIRS[name][0].from_pretrained(root / "base"), adapter).eval()
