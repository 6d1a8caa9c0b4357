"""``hf-wide serve`` as a user runs it: a process serving local members until Ctrl-C (SIGINT), or SIGTERM (``docker
stop``, Kubernetes)."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines"))  # the text members

from ports import free_port
from text_members import bert_tokenizer, build_members, save_members

pytest.importorskip("ray.serve")

from huggingface_hub import InferenceClient  # noqa: E402

from hf_wide.pipelines import pipeline  # noqa: E402
from hf_wide.serving import HAPROXY_PORTS  # noqa: E402


# SIGTERM becomes the KeyboardInterrupt that Ctrl-C raises (hf_wide.serving), whatever the ingress: the two signals
# and the two ingresses are covered in two servers' starts (half a minute to a minute and a half each), not four.
@pytest.mark.parametrize("stop, options", [(signal.SIGINT, []), (signal.SIGTERM, ["--high-throughput"])],
                         ids=["ctrl-c", "sigterm-high-throughput"])
def test_serve_answers_until_stopped_and_then_stops_cleanly(tmp_path, stop, options):
    # --high-throughput: HAProxy on the port, each request straight to the replica's own HTTP server; with Ray's
    # ports for HAProxy's stats and metrics taken, as by another such server, it takes others.
    paths = save_members(tmp_path, build_members("bert-seqcls", 2), bert_tokenizer(tmp_path / "tok"))
    port = free_port()
    taken = contextlib.ExitStack()
    if options:
        for default in HAPROXY_PORTS.values():
            taken.enter_context(_listening(default))
    log = (tmp_path / "serve.log").open("wb")  # a file, not a pipe: Ray's logs must never block the server
    # As from a terminal: Ctrl-C's signal handled. (A shell's background job, CI's say, starts with SIGINT
    # ignored, and a child inherits that: Python would then never raise KeyboardInterrupt.)
    # In a session of its own, so that what it leaves running can be found afterwards.
    proc = subprocess.Popen([sys.executable, "-m", "hf_wide.cli", "serve", *paths, "--port", str(port),
                             "--max-batch-size", "4", *options], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:  # /health answers once the replica has loaded the model
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    assert json.loads(response.read()) == {"status": "ok"}
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text(errors="replace")[-3000:]
                assert time.time() < deadline, "hf-wide serve did not come up in 180 s"
                time.sleep(1)
        got = InferenceClient(base_url=f"http://127.0.0.1:{port}").text_classification("a good day")
        want = pipeline("text-classification", model=paths)("a good day", top_k=3)["top_k"]
        assert [(e.label, e.score) for e in got] == [(e["label"], pytest.approx(e["score"], abs=1e-6)) for e in want]
        bad = urllib.request.Request(f"http://127.0.0.1:{port}/", data=b"{not json", method="POST",
                                     headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=30)
        assert refused.value.code == 400 and "JSON" in json.loads(refused.value.read())["error"]
        assert _runs_haproxy(proc.pid) == bool(options)
    finally:
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"hf-wide serve did not stop within 90 s of {stop.name}:\n"
                                 + (tmp_path / "serve.log").read_text(errors="replace")[-3000:]) from None
        finally:
            log.close()
            taken.close()
    assert code == 0, (tmp_path / "serve.log").read_text(errors="replace")[-3000:]
    assert not _left_running(proc.pid), "Ray processes of hf-wide serve are still running after it exited"


def test_high_throughput_is_refused_for_a_cluster_it_cannot_configure(capsys):
    from hf_wide.cli import main

    assert main(["serve", "org/a", "--high-throughput", "--address", "auto"]) == 2
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in capsys.readouterr().err


@pytest.mark.parametrize("options, says", [
    (["--port", "99999"], "The port must be 0-65535"), (["--replicas", "0"], "at least 1"),
    (["--max-batch-size", "0"], "at least 1"), (["--weights", "1", "2"], "combine='weighted' takes weights")])
def test_bad_options_are_refused_before_the_banner(tmp_path, capsys, no_ray, options, says):
    """They printed "hf-wide serve: ... on http://127.0.0.1:99999/ (Ctrl-C stops)" first, and then the error: the
    banner is printed once the replicas answer."""
    from hf_wide.cli import main

    paths = save_members(tmp_path, build_members("bert-seqcls", 1), bert_tokenizer(tmp_path / "tok"))
    port = [] if "--port" in options else ["--port", str(free_port())]
    with contextlib.suppress(SystemExit):  # (argparse's own refusals exit 2)
        assert main(["serve", *paths, *options, *port]) == 2
    err = capsys.readouterr().err
    assert says in err and "Ctrl-C stops" not in err


@pytest.fixture
def no_ray(monkeypatch):
    """Ray must not start: what is refused is refused before (not after Ray's seconds of starting, or its replicas'
    attempts to load the model)."""
    import ray

    def init(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", init)


def test_a_port_in_use_is_refused_before_ray_starts(capsys, no_ray):
    from hf_wide.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "org/a", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} is in use (another server?): choose another --port" in capsys.readouterr().err


@pytest.mark.parametrize("extra, says", [
    (["{missing}"], "member 1 ({missing}): there is no folder"),
    (["--task", "text-generation"], "text-generation runs members with a language-modeling head (...ForCausalLM); "
                                    "these are BertForSequenceClassification models"),
    (["--combine", "none"], "hf-wide serve answers with the ensemble's answer, and combine='none' has none"),
    # each of these started Ray first: weighted without weights failed in the replicas after half a minute, a port past
    # 65535 or another machine's address in Ray's proxy with a traceback, and more CPUs than the machine has waited
    (["--combine", "weighted"], "combine='weighted' takes weights, one per member (--weights)"),
    (["--weights", "1"], "combine='weighted' takes weights, one per member (--weights), and the other rules none"),
    (["--port", "99999"], "The port must be 0-65535, got 99999."),
    (["--host", "10.254.254.254"], "Cannot listen on 10.254.254.254:"),
    (["--num-cpus", "100000"], "1 replica(s) x 100000 CPU(s) ask Ray for 100000 CPUs, and this machine has"),
], ids=["member-not-there", "another-tasks-head", "no-combination", "weighted-without-weights", "weights-alone",
        "port-out-of-range", "host-not-here", "more-cpus-than-here"])
def test_what_would_fail_in_the_replicas_is_said_before_ray_starts(tmp_path, capsys, no_ray, extra, says):
    from hf_wide.cli import main

    paths = save_members(tmp_path, build_members("bert-seqcls", 1), bert_tokenizer(tmp_path / "tok"))
    missing = str(tmp_path / "m9")
    port = [] if "--port" in extra else ["--port", str(free_port())]
    assert main(["serve", *paths, *(e.format(missing=missing) for e in extra), *port]) == 2
    assert "hf-wide serve: error: " + says.format(missing=missing) in capsys.readouterr().err


def test_weights_for_another_number_of_members_are_refused_before_ray_starts(tmp_path, capsys, no_ray):
    # they failed in the replica, after Ray had started (half a minute)
    from hf_wide.cli import main

    paths = save_members(tmp_path, build_members("bert-seqcls", 2), bert_tokenizer(tmp_path / "tok"))
    assert main(["serve", *paths, "--combine", "weighted", "--weights", "1", "2", "3", "--port", str(free_port())]) == 2
    assert ("hf-wide serve: error: weights must hold one number per member: got (3,) for 2 members"
            in capsys.readouterr().err)


def test_allow_label_mismatch_goes_to_the_replicas(monkeypatch):
    # The load's refusal says "Pass allow_label_mismatch=True", which hf-wide serve could not take. (A replica that
    # takes it: test_app.py.)
    from hf_wide.cli import main

    calls = []
    monkeypatch.setattr("hf_wide.serving.serve", lambda models, task, **options: calls.append(options))
    assert main(["serve", "org/a", "org/b", "--allow-label-mismatch"]) == 0
    assert main(["serve", "org/a", "org/b"]) == 0
    assert [c.get("allow_label_mismatch") for c in calls] == [True, None]


def test_members_in_subfolders_are_fetched_from_them_before_ray_starts(tmp_path, capsys, no_ray):
    # The folder (or repo) and its members' subfolders, one for all or one each, fetched and checked here: their
    # head is read from the subfolders (these are classifiers, which text generation refuses), and a subfolder that
    # is not there is said before Ray starts. Serving from subfolders: test_server.py (feature extraction).
    from hf_wide.cli import main
    from hf_wide.download import MemberLoadError
    from hf_wide.serving import serve

    paths = save_members(tmp_path, build_members("bert-seqcls", 2), bert_tokenizer(tmp_path / "tok"))
    root, port = str(tmp_path), str(free_port())
    assert main(["serve", root, root, "--subfolder", *(Path(p).name for p in paths), "--task", "text-generation",
                 "--port", port]) == 2
    assert "these are BertForSequenceClassification models" in capsys.readouterr().err
    assert main(["serve", root, "--subfolder", "m7", "--port", port]) == 2
    assert (f"hf-wide serve: error: member 0 ({root}, subfolder 'm7'): there is no folder 'm7'"
            in capsys.readouterr().err)
    with pytest.raises(MemberLoadError, match="subfolder 'm7'"):  # the pipeline's own spelling of it
        serve([root], "text-classification", port=int(port), model_kwargs={"subfolder": "m7"})


def test_a_model_the_replicas_cannot_load_is_said_in_its_own_words(tmp_path):
    # Not only Ray's "Deploying application hf-wide failed: Failed to update the deployments ['WideServer']".
    tokenizer = bert_tokenizer(tmp_path / "tok")
    paths = [*save_members(tmp_path / "a", build_members("bert-seqcls", 1), tokenizer),
             *save_members(tmp_path / "b", build_members("distilbert-seqcls", 1), tokenizer)]
    done = subprocess.run([sys.executable, "-m", "hf_wide.cli", "serve", *paths, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-wide serve: error: The replicas could not load the model: "
                           "hf_wide.compat.IncompatibleMembersError: member 1"), done.stderr[-3000:]
    assert "all members must be the same model class" in last
    # One start of the replica, not Ray's three: a local Ray's replica loads what was fetched here, and fails alike.
    replicas = set(re.findall(r"ServeReplica:hf-wide:WideServer\S*\s*\(pid=(\d+)", done.stderr))
    assert len(replicas) == 1, done.stderr[-3000:]


def test_only_replicas_that_load_what_was_fetched_try_once(tmp_path):
    # A local Ray's replicas load the members fetched before it started; adapters' base they fetch themselves, and a
    # download may fail once and not twice: those keep Ray Serve's retries.
    from hf_wide.serving import _has_a_base

    full, adapter, ensemble = (tmp_path / name for name in ("full", "adapter", "ensemble"))
    for folder, name, content in [(full, "config.json", {"model_type": "bert"}),
                                  (adapter, "adapter_config.json", {"peft_type": "LORA"}),
                                  (ensemble, "config.json", {"hf_wide": {"adapters": {"base_model": "org/base"}}})]:
        folder.mkdir()
        (folder / name).write_text(json.dumps(content))
    assert [_has_a_base(f) for f in (full, adapter, ensemble)] == [False, True, True]


def test_haproxy_takes_free_ports_where_rays_are_taken(monkeypatch):
    from hf_wide.serving import DRAINING_ENV, HIGH_THROUGHPUT_ENV, _bindable, haproxy_ports, ray_environment

    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", *HIGH_THROUGHPUT_ENV, *DRAINING_ENV):
        monkeypatch.delenv(name, raising=False)
    pair = next(port for port in range(8404, 8504) if _bindable(port) and _bindable(port + 1))
    monkeypatch.setattr("hf_wide.serving.HAPROXY_PORTS", {"RAY_SERVE_HAPROXY_STATS_PORT": pair})
    with _listening(pair), _listening(pair + 1):
        (name, port), = haproxy_ports().items()
        assert name == "RAY_SERVE_HAPROXY_STATS_PORT" and int(port) > pair + 1  # the next free port above
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", int(port)))  # free
    # Never one of the kernel's ephemeral ports (the local ends of connections: one free when probed may be taken by
    # the time HAProxy starts, Ray's processes connecting meanwhile).
    low, high = (int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    monkeypatch.setattr("hf_wide.serving.HAPROXY_PORTS", {"RAY_SERVE_HAPROXY_STATS_PORT": low - 1})
    with _listening(low - 1):
        assert int(haproxy_ports()["RAY_SERVE_HAPROXY_STATS_PORT"]) > high
    monkeypatch.setattr("hf_wide.serving.HAPROXY_PORTS", {"RAY_SERVE_HAPROXY_STATS_PORT": pair})
    with monkeypatch.context() as m:  # a system that hands out every port for connections: the next free one
        m.setattr("hf_wide.serving._ephemeral_ports", lambda: (1, 65535))
        with _listening(pair), _listening(pair + 1):
            assert int(haproxy_ports()["RAY_SERVE_HAPROXY_STATS_PORT"]) > pair + 1
        m.setattr("hf_wide.serving._bindable", lambda port: False)
        with pytest.raises(ValueError, match="set RAY_SERVE_HAPROXY_STATS_PORT and RAY_SERVE_HAPROXY_METRICS_PORT"):
            haproxy_ports()
    free = next(port for port in range(9101, 9201) if _bindable(port))
    monkeypatch.setattr("hf_wide.serving.HAPROXY_PORTS", {"RAY_SERVE_HAPROXY_STATS_PORT": free})
    assert haproxy_ports() == {"RAY_SERVE_HAPROXY_STATS_PORT": str(free)}  # Ray's default, where it is free
    with ray_environment(True) as values:
        assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == values["RAY_SERVE_HAPROXY_STATS_PORT"] == str(free)
        assert all(os.environ[k] == v for k, v in {**HIGH_THROUGHPUT_ENV, **DRAINING_ENV}.items())
    assert not {"RAY_SERVE_HAPROXY_STATS_PORT", *HIGH_THROUGHPUT_ENV, *DRAINING_ENV} & set(os.environ)  # as it was
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "12345")  # the user's choices stand
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "30")
    assert haproxy_ports() == {}
    with ray_environment(True) as values:
        assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "30"
        assert not set(DRAINING_ENV) & set(values)
    with ray_environment(False) as values:
        assert values == {} and not set(HIGH_THROUGHPUT_ENV) & set(os.environ)


@contextlib.contextmanager
def _listening(port: int):
    """A socket listening on ``port`` within it (where something else already listens there: nothing)."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
            sock.listen()
        except OSError:
            pass
        yield


def _runs_haproxy(session: int) -> bool:
    """Whether a process of the session ``session`` is HAProxy (Ray Serve's high-throughput ingress)."""
    import psutil

    for process in psutil.process_iter(["name"]):
        try:
            if os.getsid(process.pid) == session and "haproxy" in (process.info["name"] or ""):
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def _left_running(session: int, wait_s: float = 30) -> bool:
    """Whether a process of the session ``session`` is still running after ``wait_s`` seconds."""
    deadline = time.time() + wait_s
    while True:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return False
        if time.time() > deadline:
            os.killpg(session, signal.SIGKILL)  # not left for the next test
            return True
        time.sleep(0.5)
