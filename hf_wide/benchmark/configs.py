"""What the benchmark runs: model specs, the presets that pair them with N, B and sequence, and inputs.

Members are transformers models with random weights built from small configs: a BERT-like encoder with a
classification head and a Llama-like causal LM. Every parameter of member i is perturbed from seed i, so
no module is identical across members (fresh norms would otherwise all be ones and be kept shared, which
real fine-tuned checkpoints do not allow). The vocabulary is small (2048) so that the transformer body,
not the embedding or the LM head, is what gets measured.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import transformers as tf
from torch import nn

from ..samples import sample_inputs
from . import COMPILE_POLICIES, PRESETS

VOCAB = 2048
MAX_POSITIONS = 512
HEAD_DIM = 64


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A BERT-like, Llama-like, T5 encoder or MPNet model of a given width and depth; with ``-lora``
    (``bert-lora``, ``llama-lora``), LoRA members of one such base: rank 8 on every linear of its layers."""

    family: str  # "bert" | "llama" | "t5" | "mpnet" | "bert-lora" | "llama-lora"
    hidden: int
    layers: int = 2

    def __post_init__(self):
        if self.base_family not in _BUILDERS or (self.lora and self.base_family not in LORA_TARGETS):
            supported = sorted([*_BUILDERS, *(f"{f}-lora" for f in LORA_TARGETS)])
            raise ValueError(f"Unknown family {self.family!r}; supported: {supported}")
        if self.hidden % HEAD_DIM:
            raise ValueError(f"hidden must be a multiple of {HEAD_DIM} (head dim); got {self.hidden}")

    @property
    def name(self) -> str:
        return f"{self.family}-h{self.hidden}-l{self.layers}"

    @property
    def lora(self) -> bool:
        return self.family.endswith("-lora")

    @property
    def base_family(self) -> str:
        return self.family.removesuffix("-lora")

    @property
    def compiles(self) -> bool:
        """Whether the benchmark compiles this family: the fused ones (vmapped modules are not compiled here)."""
        return self.family in ("bert", "llama")

    def build(self, seed: int) -> nn.Module:
        """Member ``seed``: a fresh model in eval mode, every parameter perturbed from the seed; for a LoRA
        family, the seed-0 base with an adapter of its own (A and B random from the seed)."""
        if self.lora:
            return _adapted(self.base(), seed, LORA_TARGETS[self.base_family])
        return self.base(seed)

    def base(self, seed: int = 0) -> nn.Module:
        """The model without adapters: member ``seed`` of the base family (a LoRA family's ideal)."""
        torch.manual_seed(seed)
        model = _BUILDERS[self.base_family](self.hidden, self.layers).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():  # unique tensors: a tied weight is perturbed once
                param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        return model


def _bert(hidden: int, layers: int) -> nn.Module:
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=hidden // HEAD_DIM, intermediate_size=4 * hidden,
                           max_position_embeddings=MAX_POSITIONS, num_labels=2)
    return tf.BertForSequenceClassification(config)


def _llama(hidden: int, layers: int) -> nn.Module:
    heads = hidden // HEAD_DIM
    intermediate = -(-8 * hidden // 3 // 64) * 64  # Llama's 8/3 * hidden, rounded up to a multiple of 64
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                            intermediate_size=intermediate, max_position_embeddings=MAX_POSITIONS,
                            pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return tf.LlamaForCausalLM(config)


def _t5(hidden: int, layers: int) -> nn.Module:
    config = tf.T5Config(vocab_size=VOCAB, d_model=hidden, d_kv=HEAD_DIM, d_ff=4 * hidden, num_layers=layers,
                         num_heads=hidden // HEAD_DIM)
    return tf.T5EncoderModel(config)


def _mpnet(hidden: int, layers: int) -> nn.Module:
    config = tf.MPNetConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=hidden // HEAD_DIM, intermediate_size=4 * hidden,
                            max_position_embeddings=MAX_POSITIONS, num_labels=2)
    return tf.MPNetForSequenceClassification(config)


# bert and llama have fused blocks; t5 (an encoder) and mpnet have relative position biases: t5's first attention runs
# vectorised (hf_wide.primitives.vectorised), mpnet's encoder is rewritten (hf_wide.rewrites) around fused attention.
_BUILDERS = {"bert": _bert, "llama": _llama, "t5": _t5, "mpnet": _mpnet}
# Every linear of the layers: what the LoRA configs adapt (rank 8, alpha 16).
LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "bert": ["query", "key", "value", "dense"]}
LORA_RANK = 8


def _adapted(base: nn.Module, seed: int, targets: list[str]) -> nn.Module:
    import peft

    from ..adapters import peft_quietly

    with peft_quietly():
        model = peft.get_peft_model(base, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                          target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: no update to measure
                param.copy_(0.05 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model.eval()


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark: N members of ``spec`` on a batch of B sequences of length ``seq``."""

    spec: ModelSpec
    n: int
    batch: int
    seq: int
    compile: bool = True  # run the torch.compile methods (compiling costs seconds per config)


@dataclasses.dataclass(frozen=True)
class Preset:
    configs: list[BenchConfig]
    compile: str  # which configs run under torch.compile by default: one of COMPILE_POLICIES
    target_s: float  # each method is repeated for about this long (at least 5 runs)
    max_gflop: float  # configs whose forward of all N members needs more are skipped: bounds the total time


def _grid(specs, ns, batches, seqs) -> list[BenchConfig]:
    return [BenchConfig(s, n, b, t) for s, n, b, t in itertools.product(specs, ns, batches, seqs)]


def preset_configs(name: str) -> Preset:
    """``tiny``: one config in seconds, for tests. ``quick``: under 2 minutes on 2 cores, compiling one
    config per family. ``full``: the whole grid, every config compiled (an hour or so on 2 cores). ``lora``: the
    LoRA configs alone (in both other presets too), each method timed for a second per config: wide against the
    ideal is a ratio near 1, which the presets' shorter timings leave within the machine's noise (2 minutes)."""
    if name == "tiny":
        return Preset([BenchConfig(ModelSpec("bert", 64, 1), 2, 1, 8)], "none", 0.02, 1.0)
    if name == "quick":
        small = _grid([ModelSpec("bert", 128), ModelSpec("llama", 128)], (2, 8), (1, 8), (16, 64))
        larger = [BenchConfig(ModelSpec("bert", 384), 4, 8, 64), BenchConfig(ModelSpec("llama", 256), 4, 8, 64)]
        return Preset(small + larger + _relative_bias_configs() + _lora_configs(), "subset", 0.2, 50.0)
    if name == "full":
        specs = [ModelSpec(f, h) for f in ("bert", "llama") for h in (128, 384, 768)]
        return Preset(_grid(specs, (2, 4, 8, 16), (1, 8), (16, 64, 128)) + _relative_bias_configs() + _lora_configs(),
                      "all", 0.5, 100.0)
    if name == "lora":
        return Preset(_lora_configs(), "none", 1.0, 100.0)
    raise ValueError(f"Unknown preset {name!r}; supported: {PRESETS}")


def _relative_bias_configs() -> list[BenchConfig]:
    """Families with relative position biases: the T5 encoder (its first attention vectorised) and MPNet (its
    encoder rewritten), N=8, B=1 and 8, seq 16."""
    return [BenchConfig(ModelSpec(f, 128), 8, b, 16, compile=False) for f in ("t5", "mpnet") for b in (1, 8)]


def _lora_configs() -> list[BenchConfig]:
    """N=8 LoRA adapters of rank 8 on every linear of one Llama and one BERT base (hidden 256, 2 layers)."""
    return [BenchConfig(ModelSpec(f"{f}-lora", 256), 8, b, t, compile=False)
            for f in ("llama", "bert") for b in (1, 8) for t in (16, 64)]


def apply_compile_policy(configs: list[BenchConfig], policy: str) -> list[BenchConfig]:
    """``all``: compile every config; ``none``: none; ``subset``: one per family, the smallest model at its
    largest N with the shortest sequence and smallest B (overhead-bound: where compiling matters most)."""
    if policy not in COMPILE_POLICIES:
        raise ValueError(f"Unknown compile policy {policy!r}; supported: {COMPILE_POLICIES}")
    if policy != "subset":
        return [dataclasses.replace(c, compile=policy == "all" and c.spec.compiles) for c in configs]
    chosen = {}
    for c in (c for c in configs if c.spec.compiles):
        key = (c.spec.hidden, c.seq, c.batch, -c.n)
        if c.spec.family not in chosen or key < chosen[c.spec.family][0]:
            chosen[c.spec.family] = (key, c)
    picked = {id(c) for _, c in chosen.values()}
    return [dataclasses.replace(c, compile=id(c) in picked) for c in configs]


def make_inputs(model: nn.Module, batch: int, seq: int) -> dict:
    """The same kind of inputs for every method: ``input_ids`` and ``attention_mask`` (B, seq) for text
    models (``pixel_values`` for vision ones), plus ``use_cache=False`` where the model has a KV cache."""
    torch.manual_seed(0)
    inputs = sample_inputs(model, batch, seq)
    if getattr(model.config, "use_cache", None) is not None:
        inputs["use_cache"] = False  # the sequential loop and the ideal would build caches the others do not
    return inputs
