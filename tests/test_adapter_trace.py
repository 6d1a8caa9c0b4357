"""Member 0 of adapters traced as it loads (hf_wide/adapter_trace.py): where the adapters build the same modules,
between the first adapter's load and the second's, and the fusion plans from that trace while member 0 is as it was
traced; each member against ``PeftModel.from_pretrained(base, adapter)`` run alone."""

import peft
import pytest
import torch
from conftest import CASES
from lora_members import alone, save_adapter
from oracle import TOLERANCE, max_member_error

from hf_wide import WideModel

BERT = CASES["bert-seqcls"]


def _spy_traces(monkeypatch) -> tuple[list, list]:
    """The models ``trace_members`` runs on, where the loader (``hf_wide.adapter_trace.trace_ahead``) or the fusion
    calls it, and the events in order: "load" for each adapter PEFT loads, "trace" for each trace."""
    from hf_wide import fuse, sample_trace

    traced, events, trace_members, load = [], [], sample_trace.trace_members, peft.PeftModel.from_pretrained.__func__

    def spy(model, *args, **kwargs):
        traced.append(model)
        events.append("trace")
        return trace_members(model, *args, **kwargs)

    def loads(cls, *args, **kwargs):
        events.append("load")
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(sample_trace, "trace_members", spy)
    monkeypatch.setattr(fuse, "trace_members", spy)
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", classmethod(loads))
    return traced, events


def _kinds(plan) -> dict:
    return {path: (e.kind, e.wide_class) for path, e in plan.entries.items()}


def test_adapters_alike_are_traced_once_as_member_0_loads(tmp_path, monkeypatch):
    """Adapters whose configs build the same modules (alphas apart): member 0 is traced as soon as it has loaded
    (a structural copy of it, before the other members' module trees are made, which then reuse what the export
    leaves behind), and the fusion plans from that trace, on its sample: the plan the fusion makes tracing member 0
    itself, and each member its adapter alone."""
    BERT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / f"a{seed}", seed, r=4, lora_alpha=8 * (seed + 1),
                             target_modules=["query", "value"], modules_to_save=["classifier"]) for seed in range(3)]
    traced, events = _spy_traces(monkeypatch)
    wide = WideModel.from_pretrained(adapters)
    assert events == ["load", "trace", "load", "load"] and isinstance(traced[0], peft.PeftModel)
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(3, padded=True)) <= TOLERANCE
    itself = WideModel.from_models(references)
    assert len(traced) == 2 and traced[1] is references[0]  # from_models: member 0 traced by the fusion
    assert _kinds(wide.plan) == _kinds(itself.plan) and wide.plan.total_flops == itself.plan.total_flops
    assert not wide.plan.fallbacks


def test_adapters_that_build_different_modules_are_traced_as_fused(tmp_path, monkeypatch):
    """Adapters of different targets: member 0 gains a zero update where another adapts a layer it does not, so
    it is traced by the fusion, as it is then, not as it loaded."""
    BERT.build(0).save_pretrained(tmp_path / "base")
    adapters = [save_adapter(BERT, tmp_path / "base", tmp_path / f"a{i}", i, r=4, lora_alpha=8, target_modules=targets)
                for i, targets in enumerate([["query", "value"], ["query", "key"]])]
    traced, events = _spy_traces(monkeypatch)
    wide = WideModel.from_pretrained(adapters)
    assert events == ["load", "load", "trace"]
    (member_0,) = traced
    assert any(path.endswith("attention.self.key") and hasattr(m, "lora_A") for path, m in member_0.named_modules())
    references = [alone(BERT, tmp_path / "base", a) for a in adapters]
    assert max_member_error(wide, references, BERT.inputs(3, padded=True)) <= TOLERANCE


def test_a_trace_ahead_holds_only_for_member_0_as_it_was(tmp_path, monkeypatch):
    from hf_wide import sample_trace
    from hf_wide.adapter_layers import pad_targets
    from hf_wide.adapter_trace import module_structure, trace_ahead

    BERT.build(0).save_pretrained(tmp_path / "base")
    model = alone(BERT, tmp_path / "base", save_adapter(BERT, tmp_path / "base", tmp_path / "a", 0, r=4,
                                                         target_modules=["query"]))
    sample, (trace, flops, shapes), structure = trace_ahead(model)
    assert set(sample) == {"input_ids", "attention_mask"} and flops and structure == module_structure(model)
    layer = next(p for p, _ in model.named_modules() if p.endswith("layer.0.attention.self.value"))
    pad_targets(model, {layer}, torch.float32)  # what a member gets where another adapts a layer it does not
    assert module_structure(model) != structure

    def fails(*args, **kwargs):
        raise ValueError("does not run on the sample inputs hf-wide built")

    monkeypatch.setattr(sample_trace, "trace_members", fails)
    assert trace_ahead(model) is None  # the fusion traces, and says why, as it always did

    def lost(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(sample_trace, "trace_members", lost)
    with pytest.raises(torch.AcceleratorError):
        trace_ahead(model)


def test_a_trace_ahead_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    """The collection after the trace looks at the trace's objects alone (what existed before is frozen meanwhile,
    then unfrozen); a process that froze its own objects (before forking, say) finds them frozen still."""
    import gc

    from hf_wide.adapter_trace import trace_ahead

    BERT.build(0).save_pretrained(tmp_path / "base")
    model = alone(BERT, tmp_path / "base", save_adapter(BERT, tmp_path / "base", tmp_path / "a", 0, r=4,
                                                         target_modules=["query"]))
    gc.unfreeze()
    assert trace_ahead(model) is not None and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        assert trace_ahead(model) is not None and gc.get_freeze_count() > 0  # (less those freed since: not unfrozen)
    finally:
        gc.unfreeze()
