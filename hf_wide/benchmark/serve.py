"""Load test of ``hf-wide serve``: ``python -m hf_wide.benchmark.serve [--requests 2000] [--clients 16] [--replicas 1]``.

Saves N BERT text classifiers (random weights, hidden 128, 2 layers, 3 labels) with a tokenizer, then serves them
on loopback with Ray Serve four ways, and sends each the same requests from concurrent clients (one keep-alive
connection each, one text per request):

- ``wide``: hf-wide's application, requests batched by Ray Serve (``--max-batch-size``);
- ``wide_unbatched``: the same with ``max_batch_size=1``;
- ``members``: the N transformers models run one after another for each request (what is deployed today);
- ``members_batched``: the same on Ray Serve's batches (one padded batch per model);

and, for reference, ``no_model``: the same Ray Serve deployment and batching answering at once, without a model:
what Ray Serve's request path alone allows on this machine, the ceiling of every way.

Every answer of the four is checked against ``hf_wide.pipeline`` run here on that text: the same best label,
scores within 1e-4. Every way is deployed at once, and the requests go in rounds, each way in turn, so that a slow
spell on the machine falls on all of them. Reports, per way: errors, wrong answers, throughput (requests/s), p50
and p99 latency (ms), and the CPU time a request cost in Ray Serve's HTTP proxy, the way's replicas, the clients
(this process) and Ray's other processes (:mod:`hf_wide.benchmark.cpu_share`: the cores are shared, so a way's
throughput is what they allow at that cost), as a table and, with ``--json``, a file.

It also times the two models' forwards alone, in this process, with the replica's one thread, on padded batches
of 1, 4, 8 and ``clients`` texts: the wide model (padded; padding-free, on the real tokens only; and as the
text-classification pipeline runs it, padding-free with the last layer at the texts' first tokens, which its head
reads: :mod:`hf_wide.packing`) against the members one after another. Ray Serve forms its
batches from what has arrived (on this machine, a few requests each), so these show where the wide forward gains
and how much of a request's time is the forward at all.
"""

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..serving import BATCH_WAIT_MS
from . import cpu_share
from .forward_alone import forward_alone
from .pipeline import make_texts, make_tokenizer

WAYS = ("wide", "wide_unbatched", "members", "members_batched", "no_model")


def _ranked(probs: torch.Tensor, labels: list[str]) -> list[dict]:
    order = probs.argsort(descending=True)
    return [{"label": labels[int(i)], "score": float(probs[i])} for i in order]


class _OneTextRequests:
    """The baselines' request path: one text per request, answered on Ray Serve's batches by ``answer``."""

    def __init__(self, max_batch_size: int, batch_wait_ms: float):
        self.answer.set_max_batch_size(max_batch_size)
        self.answer.set_batch_wait_timeout_s(batch_wait_ms / 1000)

    async def __call__(self, request: Request) -> JSONResponse:
        payload = json.loads(await request.body())
        return JSONResponse([await self.answer(payload["inputs"])])


@serve.deployment(max_ongoing_requests=256)
class MembersServer(_OneTextRequests):
    """The baseline: the members as transformers models, run one after another on each request (or on each of
    Ray Serve's batches); the answer is the mean of their probabilities, as hf-wide's ``combine="mean"``."""

    def __init__(self, paths: list[str], max_batch_size: int, batch_wait_ms: float):
        super().__init__(max_batch_size, batch_wait_ms)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(paths[0])
        self.models = [transformers.AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
        config = self.models[0].config
        self.labels = [config.id2label[i] for i in range(config.num_labels)]

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=BATCH_WAIT_MS / 1000)
    async def answer(self, texts: list[str]) -> list[list[dict]]:
        batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            probs = torch.stack([m(**batch).logits.softmax(-1) for m in self.models]).mean(0)  # (B, C)
        return [_ranked(p, self.labels) for p in probs]


@serve.deployment(max_ongoing_requests=256)
class NoModelServer(_OneTextRequests):
    """The reference: the members' server's request path and batching, and no model (a fixed answer, not
    checked)."""

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=BATCH_WAIT_MS / 1000)
    async def answer(self, texts: list[str]) -> list[list[dict]]:
        return [[{"label": "none", "score": 1.0}] for _ in texts]


def write_members(folder: Path, num_members: int, hidden: int) -> list[str]:
    tokenizer = make_tokenizer(folder)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=2 * hidden, max_position_embeddings=128,
                                     num_labels=3)
    paths = []
    for seed in range(num_members):
        torch.manual_seed(seed)
        path = folder / f"member-{seed}"
        transformers.BertForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def load(port: int, path: str, texts: list[str], expected: list[list[dict]] | None, clients: int) -> dict:
    """Send every text once to ``path`` (``clients`` threads, one connection each); errors, wrong answers and
    timings. ``expected`` is indexed like ``texts`` (None: answers not checked)."""
    latencies, errors, wrong, lock, next_index = [], [], [], threading.Lock(), iter(range(len(texts)))

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            body = json.dumps({"inputs": texts[i]})
            start = time.perf_counter()
            try:
                conn.request("POST", path, body, {"content-type": "application/json"})
                response = conn.getresponse()
                data = response.read()
                elapsed = time.perf_counter() - start
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
                (answer,) = json.loads(data)
            except Exception as exc:  # counted, and the connection opened again
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                continue
            want = None if expected is None else expected[i]
            right = want is None or answer[0]["label"] == want[0]["label"] and all(
                abs(a["score"] - w["score"]) <= 1e-4 for a, w in zip(answer, want))
            with lock:
                latencies.append(elapsed)
                if not right:
                    wrong.append(i)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": len(texts), "errors": errors, "wrong": len(wrong), "seconds": time.perf_counter() - start,
            "latencies": latencies}


def _summary(rounds: list[dict]) -> dict:
    """One way's rounds as one figure: requests over the seconds they took, latencies pooled."""
    seconds = sum(r["seconds"] for r in rounds)
    errors = [e for r in rounds for e in r["errors"]]
    ms = sorted(x * 1e3 for r in rounds for x in r["latencies"])
    return {"requests": sum(r["requests"] for r in rounds), "errors": len(errors),
            "wrong": sum(r["wrong"] for r in rounds), "first_error": errors[:1], "seconds": seconds,
            "requests_per_s": len(ms) / seconds,
            "rounds_requests_per_s": [len(r["latencies"]) / r["seconds"] for r in rounds],
            "p50_ms": statistics.median(ms) if ms else None,
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None}


def run(num_requests: int = 2000, clients: int = 16, num_members: int = 8, hidden: int = 128,
        max_batch_size: int = 32, batch_wait_ms: float = BATCH_WAIT_MS, port: int = 8765, ways=WAYS,
        replicas: int = 1, rounds: int = 10, high_throughput: bool = False, num_cpus: int = 1) -> dict:
    """Every way deployed at once (each under its own route prefix), then ``rounds`` rounds in which each way in
    turn gets its share of the requests: a slow spell on the machine falls on every way, not on one. ``num_cpus``:
    what Ray reserves for every replica of every way, and its torch threads."""
    import ray

    from ..pipelines import pipeline
    from ..serving import ray_environment
    from ..serving.app import build_app

    if rounds < 1 or num_requests < 1:
        raise ValueError(f"rounds and num_requests must be at least 1, got {rounds} and {num_requests}.")

    with tempfile.TemporaryDirectory(prefix="hf-wide-serve-") as tmp:
        paths = write_members(Path(tmp), num_members, hidden)
        texts = make_texts(num_requests, min_words=4, max_words=24)
        reference = pipeline("text-classification", model=paths, batch_size=64)
        expected = [r["top_k"] for r in reference(texts, top_k=3)]
        forwards = forward_alone(paths, texts, tuple(sorted({n for n in (1, 4, 8, clients) if n <= clients})))
        # num_cpus logical CPUs for every replica of every way, all deployed at once (Ray gives each replica as many
        # torch threads); they share the machine's cores, and only one way is under load at a time.
        with ray_environment(high_throughput):  # every way behind HAProxy, or every way behind Ray's proxy
            ray.init(num_cpus=len(ways) * replicas * num_cpus, include_dashboard=False, logging_level="ERROR")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        report = {"requests": num_requests, "clients": clients, "members": num_members, "hidden": hidden,
                  "max_batch_size": max_batch_size, "batch_wait_ms": batch_wait_ms, "replicas": replicas,
                  "rounds": rounds, "high_throughput": high_throughput, "num_cpus": num_cpus,
                  "forward_alone": forwards, "ways": {}}
        done: dict[str, list[dict]] = {way: [] for way in ways}
        try:
            apps = []  # deployed at once: their replicas start side by side
            for way in ways:
                batch = 1 if way in ("wide_unbatched", "members") else max_batch_size
                options = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": num_cpus}}
                if way.startswith("wide"):
                    app = build_app(paths, "text-classification", max_batch_size=batch, batch_wait_ms=batch_wait_ms,
                                    replicas=replicas, num_cpus=num_cpus)
                elif way == "no_model":
                    app = NoModelServer.options(**options).bind(batch, batch_wait_ms)
                else:
                    app = MembersServer.options(**options).bind(paths, batch, batch_wait_ms)
                apps.append(serve.RunTarget(app, name=way, route_prefix=f"/{way}"))
            serve.run_many(apps)
            for way in ways:
                load(port, f"/{way}", texts[:clients * 2], None, clients)  # warm-up
            share = -(-num_requests // rounds)
            cpu: dict[str, dict[str, float]] = {way: dict.fromkeys(cpu_share.GROUPS, 0.0) for way in ways}
            for start in range(0, num_requests, share):
                part = slice(start, start + share)
                for way in ways:
                    replica = f"ServeReplica:{way}:"  # Ray's name for the way's replica processes
                    before = cpu_share.cpu_seconds(replica)
                    done[way].append(load(port, f"/{way}", texts[part], None if way == "no_model" else expected[part],
                                          clients))
                    for group, seconds in cpu_share.spent(before, cpu_share.cpu_seconds(replica)).items():
                        cpu[way][group] += seconds
            for way in ways:
                report["ways"][way] = _summary(done[way])
                report["ways"][way]["cpu_ms_per_request"] = {g: 1e3 * t / num_requests for g, t in cpu[way].items()}
                print(f"{way}: {_row(report['ways'][way])}", file=sys.stderr)
        finally:
            serve.shutdown()
            ray.shutdown()
    ways_done = report["ways"]
    if "wide" in ways_done:
        for base in ("members", "members_batched"):
            if base in ways_done:
                report[f"wide_over_{base}"] = ways_done["wide"]["requests_per_s"] / ways_done[base]["requests_per_s"]
    return report


def _row(r: dict) -> str:
    return (f"{r['requests_per_s']:.1f} req/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"{r['errors']} errors, {r['wrong']} wrong")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT_MS)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--replicas", type=int, default=1, help="replicas of every way's deployment")
    parser.add_argument("--num-cpus", type=int, default=1,
                        help="CPUs Ray reserves for every replica of every way, and its torch threads")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--rounds", type=int, default=10, help="rounds in which every way gets its share in turn")
    parser.add_argument("--high-throughput", action="store_true",
                        help="Ray Serve's high-throughput mode (HAProxy ingress) for every way, as hf-wide serve's")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    report = run(args.requests, args.clients, args.members, max_batch_size=args.max_batch_size,
                 batch_wait_ms=args.batch_wait_ms, port=args.port, ways=args.ways, replicas=args.replicas,
                 rounds=args.rounds, high_throughput=args.high_throughput, num_cpus=args.num_cpus)
    print(f"{report['members']} BERTs (hidden {report['hidden']}), {report['requests']} requests from "
          f"{report['clients']} clients, {report['replicas']} replica(s) per way of {report['num_cpus']} CPU(s)"
          + (", Ray Serve's high-throughput mode" if report["high_throughput"] else ""))
    for way, r in report["ways"].items():
        print(f"{way:<16} {_row(r)}")
    for key in ("wide_over_members", "wide_over_members_batched"):
        if key in report:
            print(f"{key}: {report[key]:.2f}x")
    print(f"CPU ms per request ({' / '.join(cpu_share.GROUPS)}; this machine's {os.cpu_count()} cores are shared):")
    for way, r in report["ways"].items():
        ms = r["cpu_ms_per_request"]
        print(f"  {way:<16} " + " / ".join(f"{ms[g]:.2f}" for g in cpu_share.GROUPS) + f" = {sum(ms.values()):.2f}")
    print("in this process, one thread, the forward alone (ms): wide / the members one after another "
          "(wide padding-free; and at first tokens, as the pipeline runs it)")
    for f in report["forward_alone"]:
        free = "; ".join(f"{f[k]:.1f}" for k in ("wide_padding_free_ms", "wide_first_tokens_ms") if f[k] is not None)
        free = f" ({free})" if free else ""
        print(f"  batch {f['batch']}, {f['tokens']} tokens: {f['wide_ms']:.1f} / {f['members_ms']:.1f} = "
              f"{f['members_over_wide']:.2f}x{free}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
