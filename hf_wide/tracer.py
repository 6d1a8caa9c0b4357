"""The HF-aware tracer: capture the template with ``torch.export`` and plan the wide model.

transformers 5 removed its FX tracer (``transformers.utils.fx``) and ``torch.fx.symbolic_trace`` fails on
its models, so we export instead (non-strict, batch dim dynamic). The exported graph tells us, for every
op, which module called it (``nn_module_stack``); from that we learn

- which module uses each parameter (a weight read outside its own module cannot become a primitive),
- which ops mix rows of the batch (a reduction that drops the batch dim, BatchNorm in training),
- which modules run their own tensors on inputs without the batch dim (T5's and MPNet's relative
  position bias: an embedding looked up with a (query, key) table of buckets), and where that unbatched
  result is used, up to the first op whose output has the batch dim again,

and with ``torch.utils.flop_counter`` the FLOPs of every module. :func:`make_plan` turns this into a
:class:`~hf_wide.plan.WidePlan`. If export fails we plan from the module tree alone, loudly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import logging
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from . import tracer_graph as reads
from .compare import device_lost, first_line
from .primitives import roles as input_roles
from .samples import sample_kwargs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Trace:
    """What the exported graph says about the template."""

    method: str
    users: dict[str, set[str]]  # tensor fqn -> paths of the modules whose ops read it
    mixing: dict[str, str]  # module path -> the first op in it that mixes batch rows
    warnings: list[str]
    # module path -> (the first op running its tensors on an input without the batch dim, the paths of the
    # modules that use the result until it has the batch dim again)
    unbatched: dict[str, tuple[str, set[str]]] = dataclasses.field(default_factory=dict)
    # module path -> the paths of the modules that call it (XMOD's layer calls ``self.output.LayerNorm``
    # itself, not only through ``self.output``)
    callers: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # module path -> the leading dims of the tensors its calls hand to code outside it: "batch", "one" (a
    # broadcast, or a result without the batch dim such as T5's position bias of shape (1, H, T, T)), "other"
    escapes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # module path -> the leading dims of the tensors its calls take from code outside it (not its own tensors), as
    # in ``escapes``; a module that takes none (Swin's position bias, made from its table alone) is not in it
    takes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    # module path -> {structure of a call's inputs: whether each input carries the batch} (hf_wide.primitives.roles)
    roles: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)


def _release_export_graph() -> None:
    """Let the graph of an export go with its program. ``torch.export`` leaves it reachable from a module global of
    torch (fake tensor id -> graph node, cleared only when the next export starts), and with it every fake tensor of
    the trace, for as long as the process exports nothing else."""
    from torch.fx.experimental import proxy_tensor

    nodes = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(nodes, dict):
        nodes.clear()


@contextlib.contextmanager
def _quiet_failures() -> Iterator[None]:
    """An export that fails prints its partial graph to stderr (a thousand lines for Longformer) and logs each op its
    fake tensors could not run as an error, where hf-wide tries the next way and says so in the plan: both go to
    the debug log instead."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, printed = fake_log.level, io.StringIO()
    fake_log.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        fake_log.setLevel(level)
        if printed.getvalue():
            logger.debug("torch.export printed:\n%s", printed.getvalue())


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.fx keeps the Python stack of every node it records (``node.meta["stack_trace"]``, extracted and
    symbolized), unless ``torch.fx.config.do_not_emit_stack_traces`` says not to. The plan reads none of them.
    Releases of torch without the flag keep their stack traces."""
    try:
        from torch.fx import config
    except ImportError:
        config = None
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def trace(model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> Trace:
    """Export ``model`` (batch dim dynamic if it can be) and read parameter users and row mixing."""
    kwargs = sample_kwargs(model, kwargs or {})  # no cache: a DynamicCache in the output is not a pytree
    batch_dim = torch.export.Dim("batch")

    def dynamic(value):
        return {0: batch_dim} if isinstance(value, torch.Tensor) and value.dim() > 0 else None

    notes: list[str] = []
    dynamic_shapes = (tuple(dynamic(a) for a in args), {k: dynamic(v) for k, v in kwargs.items()})
    attempts = [("export (dynamic batch)", dynamic_shapes), ("export (static batch)", None)]
    program = None
    roles: dict[str, dict[str, list]] = {}
    for method, shapes in attempts:
        try:
            wrapper = _KwargsWrapper(model)
            roles.clear()  # of the dynamic batch's export, which runs every module on its symbol
            with _no_stack_traces(), _quiet_failures(), input_roles.recording(model, roles):
                program = torch.export.export(wrapper, (args, kwargs), dynamic_shapes=shapes, strict=False)
            break
        except Exception as exc:  # export raises many types; we report and try the next way
            if device_lost(exc):
                raise
            notes.append(f"{method} failed: {first_line(exc, 200)}")
        finally:
            _release_export_graph()
    if program is None:
        return Trace("module tree", {}, {}, notes)

    signature = program.graph_signature
    placeholders = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    users: dict[str, set[str]] = defaultdict(set)
    mixing: dict[str, str] = {}
    batch_symbol = None
    if method == "export (dynamic batch)":
        first_input = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name not in placeholders)
        batch_symbol = next(iter(reads.batch_symbols(first_input.meta["val"].shape)), None)
    unbatched: dict[str, tuple[str, set[str]]] = {}
    callers: dict[str, set[str]] = defaultdict(set)
    param_names = reads.weight_nodes(program.graph, set(placeholders))
    escapes = reads.escapes(program.graph, batch_symbol) if batch_symbol is not None else {}
    takes = reads.takes(program.graph, batch_symbol, param_names) if batch_symbol is not None else {}
    for node in program.graph.nodes:
        stack = reads.module_stack(node)
        for caller, callee in itertools.pairwise(stack):
            callers[callee].add(caller)
        if node.op == "placeholder" and node.name in placeholders:
            fqn = placeholders[node.name].removeprefix("model.")
            for user in node.users:
                path = reads.module_path(user)
                users[fqn].add(path)
                own = path == (fqn.rsplit(".", 1)[0] if "." in fqn else "")
                if (own and batch_symbol is not None and path not in unbatched
                        and reads.unbatched_input(user, param_names, batch_symbol)):
                    unbatched[path] = (str(user.target), reads.unbatched_uses(user, batch_symbol))
        elif node.op == "call_function" and batch_symbol is not None and reads.mixes_rows(node, batch_symbol):
            path = reads.module_path(node)
            mixing.setdefault(path, str(node.target))
    if batch_symbol is None:
        method, roles = "export (static batch)", {}
        notes.append("the batch dim was specialised by export, so ops that mix batch rows were not checked")
    return Trace(method, dict(users), mixing, notes, unbatched, dict(callers), escapes, takes, roles)


class _KwargsWrapper(nn.Module):
    """Export takes positional args; this passes (args, kwargs) through, under the name ``model``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, args, kwargs):
        return self.model(*args, **kwargs)


def module_flops(model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> dict[str, int]:
    """FLOPs of every module (subtree) for one forward of ``model`` on the given inputs; "" is the total."""
    # The counter's module tracker hooks the backward of outputs that require grad, and fails on modules
    # that return a parameter itself (DeBERTa's relative embeddings): count with grads switched off.
    requires_grad = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in requires_grad:
            p.requires_grad_(False)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*args, **(kwargs or {}))
    finally:
        for p, flag in requires_grad.items():
            p.requires_grad_(flag)
    flops = {}
    for key, per_op in counter.get_flop_counts().items():
        if key == "Global":
            continue
        fqn = key.split(".", 1)[1] if "." in key else ""
        flops[fqn] = sum(per_op.values())
    flops.setdefault("", counter.get_total_flops())
    return flops
