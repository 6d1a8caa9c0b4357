"""One rank of a member-parallel wide model, launched by tests/test_parallel.py with torchrun (gloo, CPU).

    torchrun --nproc-per-node K tests/member_parallel_worker.py SCENARIO OUT_DIR [ARGS...]

``run LLAMA_DIRS BERT_DIRS FUSED_DIR MOE_DIRS XLNET_DIRS`` (comma-separated member folders, a fused repo of the
Llama members): forward, per-member generation, ensemble decoding, the text-classification pipeline, a mixture of
experts' router logits and balancing losses, XLNet's time-major memories and a multiple-choice head's layers
(per-member outputs whose second dim is not the batch), parameter bytes, inputs that differ across ranks, saving one
fused repo (``OUT_DIR/saved``) and pushing it to the test Hub, reading a fused repo's slices, and last, a load that
must fail on every rank (a member missing on rank 1); ``load IDS``: loading only, expected to fail on some rank (as
more ranks than members). Each rank writes ``rank{r}.pt`` (what it computed, or the error it raised)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hub_server import TOKEN  # the test Hub (tests/hub_server.py) that the launching test runs

from hf_wide import PerMember, WideModel
from hf_wide.parallel import init
from hf_wide.pipelines import pipeline


def inputs(seed: int = 0) -> dict:
    ids = torch.randint(5, 90, (2, 7), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def per_member_ids() -> torch.Tensor:
    return torch.randint(5, 90, (3, 2, 5), generator=torch.Generator().manual_seed(2))  # (N, B, T)


def choices() -> dict:
    ids = torch.randint(5, 90, (2, 3, 6), generator=torch.Generator().manual_seed(3))  # (B, C, T)
    return {"input_ids": ids, "use_mems": True, "output_hidden_states": True}


def run(llama_dirs: str, bert_dirs: str, fused_dir: str, moe_dirs: str, xlnet_dirs: str, out_dir: str) -> dict:
    result = {}
    wide = WideModel.from_pretrained(llama_dirs.split(","), member_parallel=True)
    wide.save_pretrained(Path(out_dir) / "saved")  # one fused repo, written by rank 0
    result["pushed"] = wide.push_to_hub("alice/from-ranks", token=TOKEN).oid  # rank 0 uploads, every rank learns
    try:  # members shared within a rank: the ranks fuse differently, and no one plan can be written
        WideModel.from_pretrained(llama_dirs.split(","), member_parallel=True, share_identical=True).save_pretrained(
            Path(out_dir) / "refused")
        result["refused"] = None
    except Exception as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
    fused = WideModel.from_pretrained(fused_dir, member_parallel=True)  # each rank reads its members' bytes
    result["fused_local"] = list(fused.members_group.local)
    result["fused_parameter_bytes"] = sum(p.numel() * p.element_size() for p in fused.parameters())
    with torch.no_grad():
        result["fused_logits"] = fused(**inputs()).logits
    result["members"] = list(wide.member_ids)
    result["local"] = list(wide.members_group.local)
    result["parameter_bytes"] = sum(p.numel() * p.element_size() for p in wide.parameters())
    with torch.no_grad():
        result["logits"] = wide(**inputs()).logits
        result["generated"] = wide.generate(**inputs(1), max_new_tokens=6, do_sample=False)
        result["per_member"] = wide(input_ids=PerMember(per_member_ids())).logits  # each rank its members' rows
        result["loss"] = wide(**inputs(), labels=inputs()["input_ids"]).loss  # (N,): every member's, gathered
    decoder = pipeline("text-generation", model=wide, max_new_tokens=5)
    result["decoded"] = decoder(["cat sat on the", "the big dog"])
    result["sampled"] = decoder("cat sat on the", do_sample=True, top_k=5)["generated_text"]  # no seed: rank 0's
    try:  # each rank stops when its members are done: their steps' scores differ in number
        wide.generate(**inputs(1), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        result["generate_dict"] = None
    except NotImplementedError as exc:
        result["generate_dict"] = str(exc)
    try:
        with torch.no_grad():
            wide(**inputs(seed=10 + dist.get_rank()))  # each rank its own inputs: refused on every rank
        result["mismatch"] = None
    except Exception as exc:
        result["mismatch"] = f"{type(exc).__name__}: {exc}"
    try:  # generate gathers the tokens alone: each rank's members continued its own prompt, returned mixed
        wide.generate(**inputs(seed=10 + dist.get_rank()), max_new_tokens=2, do_sample=False)
        result["generate_mismatch"] = None
    except Exception as exc:
        result["generate_mismatch"] = f"{type(exc).__name__}: {exc}"
    result.update(fail_on_one_rank(wide))
    result.update(generation_configs(llama_dirs.split(","), Path(out_dir)))
    bert = WideModel.from_pretrained(bert_dirs.split(","), member_parallel=True)
    result["classified"] = pipeline("text-classification", model=bert)(["the cat sat on the mat", "a bad movie"])
    moe = WideModel.from_pretrained(moe_dirs.split(","), member_parallel=True)
    with torch.no_grad():
        routed = moe(**inputs(), labels=inputs()["input_ids"], output_router_logits=True)
    result["routed"] = {key: routed[key] for key in ("loss", "aux_loss", "router_logits")}
    with torch.no_grad():  # (N, T, B*C, D) memories and (N, B*C, T, D) layers: they stayed each rank's own
        chose = WideModel.from_pretrained(xlnet_dirs.split(","), member_parallel=True)(**choices())
    result["choices"] = {key: chose[key] for key in ("logits", "mems", "hidden_states")}
    missing = str(Path(out_dir) / "missing")
    result["missing_member"] = load([*llama_dirs.split(",")[:2], missing])  # member 2: rank 1's second
    return result


def fail_on_one_rank(wide) -> dict:
    """A call that raises on rank 1 alone (a token its member has no embedding for; a constraint that fails there):
    rank 0 waited for it to gather, and gathered its next call's outputs instead (or hung)."""
    result = {}
    oov = {"input_ids": torch.full((2, 3), 10_000)}
    try:
        with torch.no_grad():
            wide(**(inputs() if dist.get_rank() == 0 else oov))
        result["one_failed"] = None
    except Exception as exc:
        result["one_failed"] = f"{type(exc).__name__}: {exc}"
    with torch.no_grad():
        result["after_failure"] = wide(**inputs()).logits

    def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
        if dist.get_rank() == 1:
            raise ValueError("rank 1's constraint")
        return list(range(100))

    try:
        wide.generate(**inputs(1), max_new_tokens=2, do_sample=False, prefix_allowed_tokens_fn=allowed)
        result["one_failed_generate"] = None
    except Exception as exc:
        result["one_failed_generate"] = f"{type(exc).__name__}: {exc}"
    result["after_generate_failure"] = wide.generate(**inputs(1), max_new_tokens=6, do_sample=False)
    return result


def generation_configs(dirs: list[str], out_dir: Path) -> dict:
    """Member 2 (rank 1's first) saved with a repetition penalty of its own: rank 1's model runs its config, which
    was read as settings changed on every member's (rank 1 refused no generate that rank 0 refused, and waited)."""
    import json
    import shutil

    copies = [out_dir / f"generation-{i}" for i in range(len(dirs))]
    if dist.get_rank() == 0:
        for source, copy in zip(dirs, copies):
            shutil.copytree(source, copy)
        path = copies[2] / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "repetition_penalty": 1.8}))
    dist.barrier()
    wide = WideModel.from_pretrained([str(c) for c in copies], member_parallel=True)
    result = {"penalties": [c.repetition_penalty for c in wide.member_generation_configs],
              "own_penalties": [wide.member(i).generation_config.repetition_penalty for i in wide.members_group.local]}
    try:
        wide.generate(**inputs(1), max_new_tokens=3, do_sample=False)
        result["differing_generate"] = None
    except Exception as exc:
        result["differing_generate"] = f"{type(exc).__name__}: {exc}"
    result["penalised"] = wide.generate(**inputs(1), max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    return result


def load(ids: list[str]) -> dict:
    try:
        WideModel.from_pretrained(ids, member_parallel=True)
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(scenario: str, out_dir: str, *args: str) -> None:
    init(timeout=120)  # gloo here: no GPU
    try:
        result = run(*args, out_dir) if scenario == "run" else load(args[0].split(","))
        torch.save(result, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
