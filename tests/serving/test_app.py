"""hf_wide/serving/app.py in this process: which route a request's path names under the application's prefix, what
building the application refuses, a replica constructed here (over HTTP, with Ray Serve:
tests/serving/test_server.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))  # the text members
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shared helpers

from answers import close  # noqa: E402
from text_members import bert_tokenizer, build_members, save_members, sentences  # noqa: E402

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from hf_wide.pipelines import pipeline  # noqa: E402
from hf_wide.serving.app import WideServer, app_builder, build_app, route_of  # noqa: E402


def request(path: str, root_path: str = "") -> Request:
    return Request({"type": "http", "method": "POST", "path": path, "root_path": root_path, "headers": []})


@pytest.mark.parametrize("path, root, route", [
    ("/", "", "/"),
    ("/health", "", "/health"),
    ("/info/", "", "/info"),
    ("/ens", "/ens", "/"),  # the prefix itself: curl posts it without a slash
    ("/ens/", "/ens", "/"),  # InferenceClient(base_url=".../ens") posts it with one
    ("/ens/health", "/ens", "/health"),
    ("/ens/nowhere", "/ens", "/nowhere"),
    ("/health", "/ens", "/health"),  # a path given relative to the prefix
    ("/ensemble/info", "/ens", "/ensemble/info"),  # not under the prefix, only starting like it
    ("/health", "/", "/health"),  # the prefix /
    ("/ens/info", "/ens/", "/info"),
])
def test_route_below_the_prefix(path, root, route):
    assert route_of(request(path, root)) == route


# ---------------------------------------------------------------- what is refused when the application is built

@pytest.mark.parametrize("args, says", [
    ({"models": ""}, "app_builder needs models=: .* got none"),
    ({"models": " , "}, "app_builder needs models=: .* got none"),
    ({"models": "a,b", "combine": "weighted", "weights": "1,2,3"}, r"one number per member: got \(3,\) for 2 members"),
    ({"models": "a,b", "combine": "weighted", "weights": [1, -1]}, "non-negative"),
    ({"models": "a,b", "batch_wait_ms": "-3"}, "batch_wait_ms must be a finite number of 0 or more, got -3.0"),
    ({"models": "a,b", "batch_wait_ms": "inf"}, "batch_wait_ms must be a finite number"),  # a lone request: no answer
    ({"models": "a,b", "batch_size": "0"}, "batch_size must be a whole number of at least 1, got 0"),
    ({"models": "a,b", "batch_size": "-3"}, "batch_size must be a whole number of at least 1, got -3"),
    ({"models": "a,b", "max_batch_size": "0"}, "max_batch_size must be a whole number of at least 1, got 0"),
    ({"models": "a,b", "replicas": "0"}, "replicas must be a whole number of at least 1, got 0"),
    ({"models": "a,b", "num_cpus": "nan"}, "num_cpus must be a finite number of 0 or more, got nan"),
    ({"models": "a,b", "num_cpus": "-1"}, "num_cpus must be a finite number of 0 or more, got -1.0"),
    ({"models": "a", "subfolder": "x,y"}, "Got 2 subfolders for 1 members"),
])
def test_app_builder_refuses_what_the_replicas_would(args, says):
    # each was accepted, and failed in every replica once Ray had started it (or, for batch_wait_ms, in Ray Serve)
    with pytest.raises(ValueError, match=says):
        app_builder(args)


@pytest.mark.parametrize("option, value", [("max_batch_size", 2.5), ("max_batch_size", float("nan")),
                                           ("batch_size", 2.5), ("max_batch_size", True)])
def test_build_app_refuses_counts_that_are_not_whole_numbers(option, value):
    # Ray Serve took them, and each replica refused them once Ray had started it
    with pytest.raises(ValueError, match=f"{option} must be a"):
        build_app(["a", "b"], **{option: value})


def test_build_app_refuses_no_members_and_leaves_a_fused_repos_count_to_the_replica():
    with pytest.raises(ValueError, match="build_app needs the members"):
        build_app([])
    build_app("org/fused", combine="weighted", weights=[0.5, 0.3, 0.2])  # one id: the replica counts its members


def test_a_replica_takes_members_whose_labels_are_in_another_order(tmp_path):
    # The load's refusal says "Pass allow_label_mismatch=True", which neither app_builder nor hf-wide serve took.
    members = build_members("bert-seqcls", 2)
    for member, order in zip(members, [{0: "neg", 1: "pos", 2: "mixed"}, {0: "pos", 1: "mixed", 2: "neg"}]):
        member.config.id2label, member.config.label2id = order, {v: k for k, v in order.items()}
    paths = save_members(tmp_path, members, bert_tokenizer(tmp_path / "tok"))
    app = app_builder({"models": ",".join(paths), "allow_label_mismatch": "true"})
    replica = WideServer.func_or_class(*app._bound_deployment.init_args)  # as Ray Serve constructs it, in this process
    text = sentences(1, seed=21)[0]
    alone = pipeline("text-classification", model=paths, allow_label_mismatch=True)(text, top_k=3)
    assert close(replica.pipe(text, top_k=3), alone)
