"""Members with their own code (``auto_map`` in config.json, ``trust_remote_code=True``; hf_wide/own_code.py): loaded
as transformers loads them, fused, saved with their code and loaded back (before, ``trust_remote_code=True`` loaded no
checkpoint's own class: "which names no transformers class")."""

import json
import textwrap

import pytest
import torch
import transformers
from hub_server import hub  # noqa: F401  (the fixture)

from hf_wide import IncompatibleMembersError, WideModel

CONFIG_CODE = textwrap.dedent('''
    from transformers import PretrainedConfig


    class TinyConfig(PretrainedConfig):
        model_type = "tiny-own-code"

        def __init__(self, vocab_size=50, hidden_size=16, num_labels=3, **kwargs):
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            super().__init__(num_labels=num_labels, **kwargs)
''')
MODEL_CODE = textwrap.dedent('''
    import torch
    from torch import nn
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutput

    from .configuration_tiny import TinyConfig


    class TinyForSequenceClassification(PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(2))
            self.norm = nn.LayerNorm(config.hidden_size)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
            self.temperature = nn.Parameter(torch.ones(()))
            self.post_init()

        def forward(self, input_ids, attention_mask=None, **kwargs):
            h = self.embed(input_ids)
            for layer in self.layers:
                h = torch.relu(layer(h)) + h
            mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask)[..., None].to(h.dtype)
            pooled = (self.norm(h) * mask).sum(1) / mask.sum(1)
            return SequenceClassifierOutput(logits=self.classifier(pooled) * SCALE / self.temperature)
''')
AUTO_MAP = {"AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForSequenceClassification": "modeling_tiny.TinyForSequenceClassification"}


def write_member(folder, seed: int, scale: str = "1.0"):
    """A checkpoint of its own code, with weights drawn from ``seed``; ``scale``: a constant of its code."""
    folder.mkdir(parents=True)
    (folder / "configuration_tiny.py").write_text(CONFIG_CODE)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny-own-code", "auto_map": AUTO_MAP,
                                                     "architectures": ["TinyForSequenceClassification"]}))
    (folder / "modeling_tiny.py").write_text(MODEL_CODE.replace("SCALE", "1.0"))
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    transformers.AutoModelForSequenceClassification.from_config(config, trust_remote_code=True).save_pretrained(folder)
    (folder / "modeling_tiny.py").write_text(MODEL_CODE.replace("SCALE", scale))  # (saving copied the code it ran)
    return str(folder)


def alone(folder):
    return transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()


INPUTS = dict(input_ids=torch.tensor([[3, 4, 5, 6], [7, 8, 9, 1]]), attention_mask=torch.tensor([[1, 1, 1, 1],
                                                                                               [1, 1, 0, 0]]))


def errors(wide, folders) -> list[float]:
    with torch.no_grad():
        out = wide(**INPUTS).logits
        return [(out[i] - alone(folder)(**INPUTS).logits).abs().max().item() for i, folder in enumerate(folders)]


@pytest.fixture
def members(tmp_path):
    return [write_member(tmp_path / f"m{seed}", seed) for seed in range(2)]


def test_own_code_is_refused_without_trust_remote_code(members):
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        WideModel.from_pretrained(members)


def test_members_of_their_own_code_are_fused_and_saved_with_it(members, tmp_path):
    wide = WideModel.from_pretrained(members, trust_remote_code=True)
    assert max(errors(wide, members)) <= 1e-5
    assert "primitive" in wide.plan.summary()  # each member's own class, taken as one, fused
    wide.save_pretrained(tmp_path / "fused")
    assert {"configuration_tiny.py", "modeling_tiny.py"} <= {p.name for p in (tmp_path / "fused").iterdir()}
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        WideModel.from_pretrained(str(tmp_path / "fused"))
    back = WideModel.from_pretrained(str(tmp_path / "fused"), trust_remote_code=True)
    assert max(errors(back, members)) <= 1e-5
    saved = wide.save_members(tmp_path / "members")
    assert max(errors(wide, [str(folder) for folder in saved])) <= 1e-5  # each loads alone, with its code


def test_members_of_their_own_code_run_whole_are_saved_with_it(tmp_path):
    """Members whose model-level tensor differs (``temperature``, as CLIP's ``logit_scale``) run whole, vectorised:
    the root is then hf-wide's own module, whose class was taken for the members', and the saved repo held no code
    (loading it back raised "does not appear to have a file named configuration_tiny.py")."""
    folders = []
    for seed in range(2):
        folder = write_member(tmp_path / f"m{seed}", seed)
        model = alone(folder)
        model.temperature.data.fill_(1.0 + seed)
        model.save_pretrained(folder)
        (tmp_path / f"m{seed}" / "modeling_tiny.py").write_text(MODEL_CODE.replace("SCALE", "1.0"))
        folders.append(folder)
    wide = WideModel.from_pretrained(folders, trust_remote_code=True)
    assert "vectorised" in wide.plan.summary()
    wide.save_pretrained(tmp_path / "fused")
    back = WideModel.from_pretrained(str(tmp_path / "fused"), trust_remote_code=True)
    assert max(errors(back, folders)) <= 1e-5


def test_models_of_one_own_code_from_two_folders_fuse(members):
    """Loaded by the user from two folders, their classes are two objects of one code: they were refused as code
    that "differs"."""
    models = [alone(folder) for folder in members]
    assert type(models[0]) is not type(models[1])
    assert max(errors(WideModel.from_models(models), members)) <= 1e-5


def test_members_whose_own_code_differs_are_refused(tmp_path):
    folders = [write_member(tmp_path / "m0", 0), write_member(tmp_path / "m1", 1, scale="2.0")]
    with pytest.raises(IncompatibleMembersError, match="of their own code .* which differs"):
        WideModel.from_pretrained(folders, trust_remote_code=True)


def test_members_of_their_own_code_from_the_hub(hub, members, tmp_path):  # noqa: F811
    for i, folder in enumerate(members):
        hub.publish(f"alice/own-{i}", folder)
    wide = WideModel.from_pretrained(["alice/own-0", "alice/own-1"], trust_remote_code=True,
                                     cache_dir=str(tmp_path / "cache"))
    assert max(errors(wide, members)) <= 1e-5
