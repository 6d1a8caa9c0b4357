"""Tiny transformers model families for hf-wide tests.

Each `FamilyCase` names one (architecture, head) pair with a tiny config, builds
members whose every parameter (and BatchNorm running statistic) is randomised
from a seed, and makes matching dummy inputs. `FAMILIES` is the table tests
parametrise over.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import transformers as tf
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

SEQ_LEN = 7
VOCAB = 100
PAD_ID = 0
FIRST_TOKEN = 2  # real tokens avoid 0/1, so they never collide with any family's pad id
NUM_LABELS = 3
IMAGE_SIZE = 32

# Decoder-only families pad on the left, so the last position is always a real token.
DECODER_FAMILIES = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "phi3", "gemma3"})

_TEXT = dict(vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=2, num_labels=NUM_LABELS)
_BERT_LIKE = dict(_TEXT, hidden_size=32, num_attention_heads=4, intermediate_size=64)
_DECODER = dict(_BERT_LIKE, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=1)


def bert() -> PretrainedConfig:
    return tf.BertConfig(**_BERT_LIKE)


def roberta() -> PretrainedConfig:
    # RoBERTa offsets positions by pad_token_id (1), so 64 positions cover seq 7 easily.
    return tf.RobertaConfig(**_BERT_LIKE)


def xlm_roberta() -> PretrainedConfig:  # RoBERTa's code under other names: fused and packed as RoBERTa
    return tf.XLMRobertaConfig(**_BERT_LIKE)


def camembert() -> PretrainedConfig:
    return tf.CamembertConfig(**_BERT_LIKE)


def distilbert() -> PretrainedConfig:
    return tf.DistilBertConfig(vocab_size=VOCAB, max_position_embeddings=64, n_layers=2, n_heads=4,
                               dim=32, hidden_dim=64, num_labels=NUM_LABELS)


def albert() -> PretrainedConfig:
    return tf.AlbertConfig(**_BERT_LIKE, embedding_size=16)


def electra() -> PretrainedConfig:
    # embedding_size != hidden_size exercises the embeddings_project layer.
    return tf.ElectraConfig(**_BERT_LIKE, embedding_size=16)


def deberta() -> PretrainedConfig:
    return tf.DebertaConfig(**_BERT_LIKE, relative_attention=True, pos_att_type=["p2c", "c2p"],
                            max_relative_positions=16)


def deberta_v2() -> PretrainedConfig:
    return tf.DebertaV2Config(**_BERT_LIKE, relative_attention=True, pos_att_type=["p2c", "c2p"],
                              position_buckets=8, max_relative_positions=16)


def xmod() -> PretrainedConfig:
    # Language adapters picked by boolean masks over the batch (a per-member fallback), and a layer that calls
    # its output's LayerNorm itself.
    return tf.XmodConfig(**_BERT_LIKE, languages=["en_XX", "de_DE"], default_language="en_XX")


def mpnet() -> PretrainedConfig:
    return tf.MPNetConfig(**_BERT_LIKE)


def t5() -> PretrainedConfig:
    # Relative position bias from an embedding looked up with a (query, key) table: no batch dim.
    return tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, pad_token_id=PAD_ID)


def gpt2() -> PretrainedConfig:
    return tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                         num_labels=NUM_LABELS, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=1)


def llama() -> PretrainedConfig:
    return tf.LlamaConfig(**_DECODER, num_key_value_heads=2, tie_word_embeddings=True)


def mistral() -> PretrainedConfig:
    return tf.MistralConfig(**_DECODER, num_key_value_heads=2)


def mixtral() -> PretrainedConfig:
    # Router and experts see (N*B*T, D) tokens: per-member fallbacks over token rows.
    return tf.MixtralConfig(**_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def qwen2() -> PretrainedConfig:
    return tf.Qwen2Config(**_DECODER, num_key_value_heads=4)


def phi3() -> PretrainedConfig:
    # Phi-3 defaults pad/eos to 32000, which would be out of range for a 100-token vocab.
    return tf.Phi3Config(**_DECODER, num_key_value_heads=4, original_max_position_embeddings=64)


def gemma3() -> PretrainedConfig:
    # Scaled word embeddings, (1 + w) RMSNorms on hidden states, queries and keys; a sliding-window layer.
    return tf.Gemma3TextConfig(**_DECODER, num_key_value_heads=2, head_dim=8, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"])


def vit() -> PretrainedConfig:
    return tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        image_size=IMAGE_SIZE, patch_size=8, num_channels=3, num_labels=NUM_LABELS)


def resnet() -> PretrainedConfig:
    return tf.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                           layer_type="basic", num_labels=NUM_LABELS)


def members_from(model_class: type, config: PretrainedConfig, seeds) -> list[PreTrainedModel]:
    """One model of ``model_class`` per seed, every parameter randomised from it, in eval mode."""
    members = []
    for seed in seeds:
        model = model_class(config)
        randomise_(model, seed)  # the norms too: they become wide, not shared
        members.append(model.eval())
    return members


@torch.no_grad()
def randomise_(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter and BatchNorm running stat in place from `seed`.

    Iterating modules and de-duplicating by identity visits each tied tensor once,
    and writing in place keeps the tie intact.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, dtype=t.dtype)

    seen: set[int] = set()
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()  # LayerNorm, *RMSNorm, BatchNorm2d
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if is_norm and name == "weight":
                param.copy_(1 + 0.1 * randn(param))
            elif name == "bias":
                param.copy_(0.05 * randn(param))
            else:
                param.copy_(0.1 * randn(param))
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.copy_(0.1 * randn(module.running_mean))
            rand = torch.rand(module.running_var.shape, generator=gen, dtype=module.running_var.dtype)
            module.running_var.copy_(0.5 + rand)  # strictly positive


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    id: str
    family: str
    model_class: type
    make_config: Callable[[], PretrainedConfig]
    input_kind: str  # "text" or "image"
    causal_lm: bool = False

    @property
    def padding_side(self) -> str:
        return "left" if self.family in DECODER_FAMILIES else "right"

    def build(self, seed: int) -> PreTrainedModel:
        model = self.model_class(self.make_config()).float()
        randomise_(model, seed)
        return model.eval()

    def inputs(self, batch: int, padded: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        # Rows are drawn one at a time so row 0 is identical whatever the batch size.
        gen = torch.Generator().manual_seed(seed)
        if self.input_kind == "image":
            config = self.make_config()
            size = getattr(config, "image_size", IMAGE_SIZE)
            shape = (1, config.num_channels, size, size)
            rows = [torch.randn(shape, generator=gen) for _ in range(batch)]
            return {"pixel_values": torch.cat(rows)}

        pad_id = self.make_config().pad_token_id
        pad_id = PAD_ID if pad_id is None else pad_id
        ids = torch.cat([torch.randint(FIRST_TOKEN, VOCAB, (1, SEQ_LEN), generator=gen) for _ in range(batch)])
        mask = torch.ones_like(ids)
        if padded:
            for row in range(1, batch):
                n_pad = min(row + 1, SEQ_LEN - 1)  # always keep at least one real token
                cols = slice(0, n_pad) if self.padding_side == "left" else slice(SEQ_LEN - n_pad, SEQ_LEN)
                mask[row, cols] = 0
                ids[row, cols] = pad_id  # seq-cls heads of decoders find the last token via pad_token_id
        return {"input_ids": ids, "attention_mask": mask}


def text_batch(batch: int = 2, length: int = SEQ_LEN, padded: bool = True) -> dict[str, torch.Tensor]:
    """Random ids (seed 0); with ``padded``, the last three positions of every row after the first are padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[1:, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _case(id: str, family: str, cls: type, make_config, input_kind: str = "text", causal_lm: bool = False):
    return FamilyCase(id, family, cls, make_config, input_kind, causal_lm)


FAMILIES: list[FamilyCase] = [
    _case("bert-base", "bert", tf.BertModel, bert),
    _case("bert-seqcls", "bert", tf.BertForSequenceClassification, bert),
    _case("bert-tokcls", "bert", tf.BertForTokenClassification, bert),
    _case("roberta-seqcls", "roberta", tf.RobertaForSequenceClassification, roberta),
    _case("roberta-tokcls", "roberta", tf.RobertaForTokenClassification, roberta),
    _case("xlm-roberta-seqcls", "xlm-roberta", tf.XLMRobertaForSequenceClassification, xlm_roberta),
    _case("camembert-tokcls", "camembert", tf.CamembertForTokenClassification, camembert),
    _case("distilbert-base", "distilbert", tf.DistilBertModel, distilbert),
    _case("distilbert-seqcls", "distilbert", tf.DistilBertForSequenceClassification, distilbert),
    _case("albert-seqcls", "albert", tf.AlbertForSequenceClassification, albert),
    _case("electra-seqcls", "electra", tf.ElectraForSequenceClassification, electra),
    _case("electra-tokcls", "electra", tf.ElectraForTokenClassification, electra),
    _case("xmod-seqcls", "xmod", tf.XmodForSequenceClassification, xmod),
    _case("mpnet-base", "mpnet", tf.MPNetModel, mpnet),  # sentence embeddings (all-mpnet-base-v2)
    _case("mpnet-seqcls", "mpnet", tf.MPNetForSequenceClassification, mpnet),
    _case("t5-encoder", "t5", tf.T5EncoderModel, t5),
    _case("deberta-seqcls", "deberta", tf.DebertaForSequenceClassification, deberta),
    _case("deberta-v2-seqcls", "deberta-v2", tf.DebertaV2ForSequenceClassification, deberta_v2),
    _case("deberta-v2-tokcls", "deberta-v2", tf.DebertaV2ForTokenClassification, deberta_v2),
    _case("gpt2-causallm", "gpt2", tf.GPT2LMHeadModel, gpt2, causal_lm=True),
    _case("gpt2-seqcls", "gpt2", tf.GPT2ForSequenceClassification, gpt2),
    _case("llama-causallm", "llama", tf.LlamaForCausalLM, llama, causal_lm=True),
    _case("llama-seqcls", "llama", tf.LlamaForSequenceClassification, llama),
    _case("mistral-causallm", "mistral", tf.MistralForCausalLM, mistral, causal_lm=True),
    _case("mixtral-causallm", "mixtral", tf.MixtralForCausalLM, mixtral, causal_lm=True),
    _case("qwen2-causallm", "qwen2", tf.Qwen2ForCausalLM, qwen2, causal_lm=True),
    _case("phi3-causallm", "phi3", tf.Phi3ForCausalLM, phi3, causal_lm=True),
    _case("gemma3-causallm", "gemma3", tf.Gemma3ForCausalLM, gemma3, causal_lm=True),
    _case("vit-imgcls", "vit", tf.ViTForImageClassification, vit, input_kind="image"),
    _case("resnet-imgcls", "resnet", tf.ResNetForImageClassification, resnet, input_kind="image"),
]


def with_gain(attention_class: type[nn.Module]) -> type[nn.Module]:
    """A subclass of a decoder's attention that reads a raw parameter in its forward: no block knows it,
    so it falls back per member."""

    class GainAttention(attention_class):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.gain = nn.Parameter(torch.ones(()))

        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states * self.gain, *args, **kwargs)

    return GainAttention


def fall_back_attention_(members: list[PreTrainedModel], layer: int, attention_class: type[nn.Module]) -> None:
    """Give layer ``layer`` of every decoder member a :func:`with_gain` attention, gain 1 + 0.1 * i."""
    for i, member in enumerate(members):
        decoder_layer = member.model.layers[layer]
        attention = with_gain(attention_class)(member.config, layer)
        attention.load_state_dict(decoder_layer.self_attn.state_dict(), strict=False)
        attention.gain.data.fill_(1.0 + 0.1 * i)
        decoder_layer.self_attn = attention
