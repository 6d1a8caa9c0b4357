"""The Ray Serve application: one wide pipeline per replica, concurrent requests batched into its forwards.

    app = build_app(["org/a", "org/b"], task="text-classification", max_batch_size=32)
    serve.run(app)          # or compose it into your own Ray Serve graph, or ``serve run module:app``

Routes: ``POST /`` (the Inference API payloads of :mod:`hf_wide.serving.tasks`), ``GET /health`` (answered
once the replica's model is loaded: Ray Serve routes to a replica only after its constructor returns) and
``GET /info`` (members, revisions, task, plan summary). Batching is Ray Serve's ``@serve.batch``: the
requests waiting when the replica is free, and those that come within ``batch_wait_ms`` of its taking the first, up
to ``max_batch_size``, run as one call of :func:`hf_wide.pipelines.requests.run_requests`, which answers each one
as the pipeline would alone.
"""

import math
import numbers
from collections.abc import Sequence

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import BATCH_WAIT_MS
from .payloads import BadRequest
from .tasks import task_format

ROUTES = {"/": "POST", "/health": "GET", "/info": "GET"}


def _error(message: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def route_of(request: Request) -> str:
    """The request's path below the application's route prefix (``root_path``): ``/`` for the prefix itself,
    with or without its slash (``InferenceClient`` posts ``base_url=".../prefix"`` as ``/prefix/``, curl as
    ``/prefix``)."""
    path, root = request.scope.get("path", "/"), request.scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path.rstrip("/") or "/"


@serve.deployment(max_ongoing_requests=256)
class WideServer:
    """One replica: the members fused into one wide model, behind a pipeline for ``task``. Its three routes are
    dispatched here, on the request's path and method: a web framework's routing and middleware would cost
    more per request than the rest of the request path (Ray Serve's own HTTP handling aside)."""

    def __init__(self, model_ids: Sequence[str] | str, task: str, pipeline_options: dict,
                 max_batch_size: int = 32, batch_wait_ms: float = BATCH_WAIT_MS):
        from ..pipelines import pipeline  # in the replica's process

        self.task = task
        self.pipe = pipeline(task, model=model_ids, **pipeline_options)
        self.format = task_format(task, self.pipe)
        self.batched.set_max_batch_size(max_batch_size)
        self.batched.set_batch_wait_timeout_s(batch_wait_ms / 1000)

    async def __call__(self, request: Request) -> JSONResponse:
        route = route_of(request)
        method = ROUTES.get(route)
        if method is None:
            return _error(f"There is no {route} here: POST / (the task's payloads), GET /health, GET /info.", 404)
        if request.method != method:
            return _error(f"{route} takes {method}, not {request.method}.", 405, {"Allow": method})
        if route == "/":
            return await self.infer(request)
        return JSONResponse(self.health() if route == "/health" else self.info())

    def health(self) -> dict:
        return {"status": "ok"}

    def info(self) -> dict:
        wide = self.pipe.model
        return {"task": self.task, "num_members": wide.num_members, "members": list(wide.member_ids),
                "revisions": list(getattr(wide, "member_revisions", None) or []),
                "combine": self.pipe.combine.value, "plan": wide.plan.summary()}

    async def infer(self, request: Request) -> JSONResponse:
        try:
            checked = self.format.parse_body(await request.body(), request.headers.get("content-type", ""))
        except BadRequest as exc:
            return _error(str(exc), exc.status)
        answers = await self.batched((checked.items, checked.options))
        if isinstance(answers, (TypeError, ValueError)):  # the request's inputs or options, refused
            return _error(self.format.refusal(str(answers)), 422)
        if isinstance(answers, Exception):
            return _error(f"The model failed on this request: {type(answers).__name__}: {answers}", 500)
        return JSONResponse(self.format.respond(checked, answers))

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=BATCH_WAIT_MS / 1000)
    async def batched(self, requests: list[tuple[list, dict]]) -> list:
        from ..pipelines.requests import run_requests

        return run_requests(self.pipe, requests)


def build_app(model_ids: Sequence[str] | str, task: str = "text-classification", *, replicas: int = 1,
              max_batch_size: int = 32, batch_wait_ms: float = BATCH_WAIT_MS, num_cpus: float | None = None,
              max_constructor_retry_count: int | None = None, subfolder: str | Sequence[str] | None = None,
              **pipeline_options) -> serve.Application:
    """The Ray Serve application serving ``model_ids`` (members, a fused repo, adapters, local folders) for
    ``task``; ``num_cpus`` is what Ray reserves for each replica (Ray's default: 1; it also sets the replica's
    torch threads), ``max_constructor_retry_count`` how many times Ray Serve starts a replica whose constructor failed
    (its default: three per replica, at most 20), ``subfolder`` where in its repo each member is (one for all, or
    one per member, as :meth:`~hf_wide.WideModel.from_pretrained` takes it), and ``pipeline_options`` go to
    :func:`hf_wide.pipeline` (``combine``, ``compile``, ``batch_size``, ``revision``, ``token``,
    ``allow_label_mismatch``, ...). What the replicas would refuse is refused here where it can be, before Ray
    starts them."""
    from ..download import as_ids, per_member
    from ..pipelines import Combine
    from ..pipelines.combine import check_weights
    from .tasks import check_task

    check_task(task)
    ids = as_ids(model_ids)
    if not ids:
        raise ValueError("build_app needs the members: repo ids or folders, a fused repo, or adapters; got none.")
    _check_numbers(replicas, max_batch_size, batch_wait_ms, num_cpus, pipeline_options.get("batch_size"))
    combine = Combine.parse(pipeline_options.get("combine", Combine.MEAN))
    if combine == Combine.NONE:
        raise ValueError("hf-wide serve answers with the ensemble's answer, and combine='none' has none: choose a "
                         "combination rule (mean, vote, ...); every member's answer comes with it.")
    if (combine == Combine.WEIGHTED) != (pipeline_options.get("weights") is not None):
        raise ValueError("combine='weighted' takes weights, one per member (--weights), and the other rules none.")
    if len(ids) > 1:  # one id may be a fused repo, whose members only the replicas see
        check_weights(pipeline_options.get("weights"), len(ids))
    per_member(subfolder, len(ids), "subfolder")  # one for all, or one per member: another count is refused
    if subfolder:
        pipeline_options["model_kwargs"] = {**(pipeline_options.get("model_kwargs") or {}), "subfolder": subfolder}
    pipeline_options.setdefault("batch_size", max_batch_size)  # one Ray batch, one forward where it fits
    options = {"num_replicas": replicas, "ray_actor_options": {} if num_cpus is None else {"num_cpus": num_cpus}}
    if max_constructor_retry_count is not None:
        options["max_constructor_retry_count"] = max_constructor_retry_count
    return WideServer.options(**options).bind(
        model_ids, task, pipeline_options, max_batch_size, batch_wait_ms)


def _check_numbers(replicas, max_batch_size, batch_wait_ms, num_cpus, batch_size) -> None:
    """The counts and times of :func:`build_app`, checked before Ray starts: a fractional or NaN ``max_batch_size``
    and a ``batch_size`` (the pipeline's) below 1 were taken, and failed in every replica once Ray had started it;
    an endless ``batch_wait_ms`` would keep a lone request waiting for company; Ray's refusal of a NaN ``num_cpus``
    ("cannot convert float NaN to integer") named no argument."""
    from ..pipelines.options import whole_number

    whole_number("replicas", replicas)
    whole_number("max_batch_size", max_batch_size)
    if batch_size is not None:  # the pipeline's forward size (default: max_batch_size)
        whole_number("batch_size", batch_size)
    if not _finite_non_negative(batch_wait_ms):
        raise ValueError(f"batch_wait_ms must be a finite number of 0 or more, got {batch_wait_ms!r}.")
    if num_cpus is not None and not _finite_non_negative(num_cpus):
        raise ValueError(f"num_cpus must be a finite number of 0 or more, got {num_cpus!r}.")


def _finite_non_negative(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 <= value < math.inf  # (NaN: False)


def app_builder(args: dict) -> serve.Application:
    """:func:`build_app` from text arguments, for Ray Serve's command line and config files::

        serve run hf_wide.serving.app:app_builder models=org/a,org/b task=text-classification replicas=2

        # serve_config.yaml (serve deploy / serve run serve_config.yaml)
        applications:
          - name: ensemble
            route_prefix: /
            import_path: hf_wide.serving.app:app_builder
            args: {models: [org/a, org/b], task: text-classification, max_batch_size: 32}

    ``subfolder`` is one folder for every member, or one per member (comma-separated or a YAML list);
    ``allow_label_mismatch=true`` takes members whose ``id2label`` holds the same labels in another order.
    """
    options = dict(args)
    if "models" not in options:
        raise ValueError("app_builder needs models=: member repo ids or folders, comma-separated (or a YAML list).")
    models = options.pop("models")
    models = [m.strip() for m in models.split(",") if m.strip()] if isinstance(models, str) else list(models)
    if not models:
        raise ValueError("app_builder needs models=: member repo ids or folders, comma-separated (or a YAML list); "
                         "got none.")
    unknown = sorted(set(options) - set(_ARGS))
    if unknown:
        raise ValueError(f"app_builder got unknown argument(s) {', '.join(unknown)}; it takes models, "
                         f"{', '.join(_ARGS)}.")
    return build_app(models, **{name: _ARGS[name](value) for name, value in options.items()})


def _flag(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"Expected true or false, got {value!r}.")


def _subfolders(value) -> str | list[str]:
    """One subfolder for every member, or one per member (comma-separated or a YAML list)."""
    folders = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v) for v in value]
    return folders[0] if len(folders) == 1 else folders


def _numbers(value) -> list[float]:
    """Weights as a YAML list or comma-separated text."""
    return [float(v) for v in (value.split(",") if isinstance(value, str) else value)]


_ARGS = {"task": str, "replicas": int, "max_batch_size": int, "batch_wait_ms": float, "num_cpus": float,
         "combine": str, "weights": _numbers, "compile": _flag, "revision": str, "batch_size": int,
         "subfolder": _subfolders, "allow_label_mismatch": _flag}
