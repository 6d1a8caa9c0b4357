"""hf_wide/parallel.py: member parallelism over torch.distributed. Two (or three) CPU processes launched with
torchrun (gloo, loopback) each hold a slice of the members; what every rank returns equals the single-process
wide model's exactly, N = 3 members over 2 ranks (uneven); failures raise on every rank, and nothing hangs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent / "pipelines"))  # the text members

from answers import close  # noqa: E402
from conftest import CASES  # noqa: E402
from hub_server import running_hub  # noqa: E402
from member_parallel_worker import choices, inputs, per_member_ids  # noqa: E402
from text_members import bert_tokenizer, build_members, decoder_tokenizer, save_members  # noqa: E402

from hf_wide import PerMember, WideModel  # noqa: E402
from hf_wide.parallel import MemberGroup, member_slices  # noqa: E402
from hf_wide.pipelines import pipeline  # noqa: E402

WORKER = Path(__file__).resolve().parent / "member_parallel_worker.py"  # tests/ is its PYTHONPATH
TIMEOUT = 240  # seconds: a hang fails the test instead of the CI run


# gloo's own failure to connect the ranks, before any of hf-wide's code runs (once in a fresh clone's test run on a
# loaded two-core machine: "Connection closed by peer", while the same test passed alone every time)
GLOO_CONNECT = "connectFullMesh failed"


def torchrun(nproc: int, *args: str, out: Path) -> list[dict]:
    """Launch the worker on ``nproc`` ranks; each rank's result. Launched once more where gloo failed to connect
    the ranks (:data:`GLOO_CONNECT`), and only then."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(WORKER.parent)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(WORKER), *args[:1], str(out), *args[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0 and GLOO_CONNECT in done.stderr:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    llama = save_members(root / "llama", build_members("llama-causallm", 3), decoder_tokenizer(root / "dec"))
    bert = save_members(root / "bert", build_members("bert-seqcls", 3, {0: "neg", 1: "pos", 2: "mixed"}),
                        bert_tokenizer(root / "tok"))
    moe = []
    for seed in range(3):  # a mixture of experts: its router logits and load-balancing losses, gathered
        torch.manual_seed(seed)
        config = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16)
        transformers.Qwen2MoeForCausalLM(config).save_pretrained(root / f"moe-{seed}")
        moe.append(str(root / f"moe-{seed}"))
    xlnet = []
    for seed in range(3):
        torch.manual_seed(seed)
        config = transformers.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=4, d_inner=64)
        transformers.XLNetForMultipleChoice(config).save_pretrained(root / f"xlnet-{seed}")
        xlnet.append(str(root / f"xlnet-{seed}"))
    return root, llama, bert, moe, xlnet


@pytest.fixture(scope="module")
def ranks(members):
    """Every rank's results; the test Hub the ranks pushed to stays up (and the Hub client pointed at it) until
    this module's tests are done."""
    root, llama, bert, moe, xlnet = members
    out = root / "run"
    out.mkdir()
    WideModel.from_pretrained(llama).save_pretrained(root / "fused")
    with running_hub(root / "hub"):  # its environment reaches the ranks
        yield torchrun(2, "run", ",".join(llama), ",".join(bert), str(root / "fused"), ",".join(moe), ",".join(xlnet),
                       out=out)


def test_member_slices_are_contiguous_and_even():
    assert member_slices(3, 2) == (range(0, 2), range(2, 3))
    assert [len(s) for s in member_slices(8, 3)] == [3, 3, 2]
    assert MemberGroup(1, member_slices(5, 2)).local == range(3, 5)
    with pytest.raises(ValueError, match="over 3 ranks needs at least 3 members"):
        member_slices(2, 3)


def test_member_parallel_without_torch_distributed_says_how():
    with pytest.raises(RuntimeError, match="torchrun"):
        WideModel.from_pretrained(["a", "b"], member_parallel=True)


def test_every_rank_returns_what_one_process_computes(members, ranks):
    _, llama, bert, moe, xlnet = members
    wide = WideModel.from_pretrained(llama)
    with torch.no_grad():
        logits = wide(**inputs()).logits
        generated = wide.generate(**inputs(1), max_new_tokens=6, do_sample=False)
        per_member = wide(input_ids=PerMember(per_member_ids())).logits
        loss = wide(**inputs(), labels=inputs()["input_ids"]).loss
    decoded = pipeline("text-generation", model=wide, max_new_tokens=5)(["cat sat on the", "the big dog"])
    classified = pipeline("text-classification", model=bert)(["the cat sat on the mat", "a bad movie"])
    with torch.no_grad():
        routed = WideModel.from_pretrained(moe)(**inputs(), labels=inputs()["input_ids"], output_router_logits=True)
        chose = WideModel.from_pretrained(xlnet)(**choices())
    for rank in ranks:  # the same tokens, texts and labels; floats to the last bits (kernels block by batch size)
        assert rank["members"] == llama
        assert rank["logits"] == pytest.approx(logits, abs=1e-6, rel=0)
        assert torch.equal(rank["generated"], generated)
        assert rank["per_member"] == pytest.approx(per_member, abs=1e-6, rel=0)
        assert rank["loss"].shape == (3,) and rank["loss"] == pytest.approx(loss, abs=1e-6, rel=0)
        assert close(rank["decoded"], decoded) and close(rank["classified"], classified)
        assert rank["routed"]["loss"].shape == rank["routed"]["aux_loss"].shape == (3,)
        for key in ("loss", "aux_loss"):
            assert rank["routed"][key] == pytest.approx(routed[key], abs=1e-6, rel=0)
        for got, want in zip(rank["routed"]["router_logits"], routed.router_logits, strict=True):  # (N, B*T, E)
            assert got == pytest.approx(want, abs=1e-6, rel=0)
        for key in ("logits", "mems", "hidden_states"):  # every member's, on every rank
            for got, want in zip(torch.utils._pytree.tree_leaves(rank["choices"][key]),
                                 torch.utils._pytree.tree_leaves(chose[key]), strict=True):
                assert got.shape == want.shape and got == pytest.approx(want, abs=1e-5, rel=0), key
    assert [r["local"] for r in ranks] == [[0, 1], [2]]
    assert all("return_dict_in_generate" in r["generate_dict"] for r in ranks)  # refused on every rank
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # sampling without a seed: the same draws on every rank


def test_each_rank_holds_its_share_of_the_parameters(members, ranks):
    _, llama, _, _, _ = members
    def size(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def alone(ids):  # fused in one process as a rank fuses its slice: each member keeps its own tensors
        return size(WideModel.from_pretrained(ids, share_identical=False))

    assert [r["parameter_bytes"] for r in ranks] == [alone(llama[:2]), alone(llama[2:])]
    assert ranks[1]["parameter_bytes"] < ranks[0]["parameter_bytes"] < alone(llama)
    assert sum(r["parameter_bytes"] for r in ranks) == alone(llama)


def test_ranks_given_different_inputs_all_raise(ranks):
    for rank in ranks:
        assert rank["mismatch"] is not None and "different inputs" in rank["mismatch"]
        assert rank["generate_mismatch"] is not None and "different inputs" in rank["generate_mismatch"]


def test_a_call_that_raises_on_one_rank_raises_on_every_rank(members, ranks):
    # rank 0 waited for rank 1's outputs to gather and gathered those of its next call (or hung there)
    wide = WideModel.from_pretrained(members[1])
    with torch.no_grad():
        logits = wide(**inputs()).logits
        generated = wide.generate(**inputs(1), max_new_tokens=6, do_sample=False)
    for key, error in (("one_failed", "IndexError: index out of range"), ("one_failed_generate",
                                                                          "ValueError: rank 1's constraint")):
        assert ranks[0][key].startswith("MemberParallelError: The call failed on 1 of 2 ranks: rank 1 (member 2): "
                                        + error.split(":")[0]), ranks[0][key]
        assert ranks[1][key].startswith(error), ranks[1][key]  # its own error, with a note for the others
    for rank in ranks:  # the next calls: every rank's own
        assert rank["after_failure"] == pytest.approx(logits, abs=1e-6, rel=0)
        assert torch.equal(rank["after_generate_failure"], generated)


def test_each_rank_holds_every_members_own_generation_config(members, ranks):
    # rank 1's model runs its first member's config (member 2's): its differences from member 0's were read as
    # settings changed on the wide model, and given to every member there
    wide = WideModel.from_pretrained(members[1])
    penalised = wide.generate(**inputs(1), max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    for rank, local in zip(ranks, ([1.0, 1.0], [1.8])):
        assert [p or 1.0 for p in rank["penalties"]] == [1.0, 1.0, 1.8]  # (None: unset, transformers' 1.0)
        assert [p or 1.0 for p in rank["own_penalties"]] == local
        assert "repetition_penalty: member 0 1.0, member 2 1.8" in rank["differing_generate"]  # on every rank
        assert torch.equal(rank["penalised"], penalised)


def test_members_done_early_are_padded_as_one_process_pads_them():
    # with no pad token, transformers pads with the first end-of-sequence token: the ranks padded with 0
    from transformers import GenerationConfig

    from hf_wide.generation import pad_token

    model = CASES["llama-causallm"].build(0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = None, [5, 75]
    assert pad_token({}, model) == 5
    assert pad_token({"eos_token_id": 9}, model) == 9 and pad_token({"pad_token_id": 3}, model) == 3
    assert pad_token({"generation_config": GenerationConfig(eos_token_id=[7, 8])}, model) == 7


def test_a_member_that_cannot_be_loaded_fails_every_rank(ranks):
    for rank in ranks:
        assert "MemberParallelError" in rank["missing_member"]["error"]
        assert "rank 1 (member 2)" in rank["missing_member"]["error"]


def test_more_ranks_than_members_fails_every_rank(members, tmp_path):
    _, llama, _, _, _ = members
    results = torchrun(3, "load", ",".join(llama[:2]), out=tmp_path)
    for result in results:
        assert "needs at least 3 members" in result["error"]


def test_a_fused_repo_is_read_a_slice_per_rank(members, ranks):
    _, llama, _, _, _ = members
    wide = WideModel.from_pretrained(llama)
    with torch.no_grad():
        logits = wide(**inputs()).logits
    for rank in ranks:
        assert rank["fused_logits"] == pytest.approx(logits, abs=1e-6, rel=0)
    assert [r["fused_local"] for r in ranks] == [[0, 1], [2]]
    assert ranks[1]["fused_parameter_bytes"] < ranks[0]["fused_parameter_bytes"]


def test_saving_from_the_ranks_writes_the_repo_one_process_writes(members, ranks, tmp_path):
    from safetensors.torch import load_file

    from hf_wide.saving import read_section

    root, llama, _, _, _ = members
    saved = root / "run" / "saved"
    one = WideModel.from_pretrained(llama, share_identical=False)  # as the ranks fuse theirs
    one.save_pretrained(tmp_path / "one")
    files = sorted(p.name for p in saved.glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    for name in files:
        got, want = load_file(saved / name), load_file(tmp_path / "one" / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert read_section(saved) == read_section(tmp_path / "one")
    with torch.no_grad():
        back = WideModel.from_pretrained(str(saved))(**inputs()).logits
        assert torch.equal(back, one(**inputs()).logits)


def test_push_to_hub_from_the_ranks(members, ranks):
    _, llama, _, _, _ = members
    assert ranks[0]["pushed"] == ranks[1]["pushed"]  # rank 0's commit, known to every rank
    one = WideModel.from_pretrained(llama, share_identical=False)
    with torch.no_grad():
        back = WideModel.from_pretrained("alice/from-ranks")(**inputs()).logits
        assert torch.equal(back, one(**inputs()).logits)


def test_saving_ranks_that_fused_differently_is_refused(ranks):
    for rank in ranks:
        assert "fused its members differently" in rank["refused"] and "share_identical=False" in rank["refused"]
