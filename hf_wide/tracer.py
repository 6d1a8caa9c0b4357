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
import re
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

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


def _module_stack(node: torch.fx.Node) -> list[str]:
    """The paths of the modules an op was called in, outermost first (the exported wrapper's prefix cut)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [_unslice(path.removeprefix("model").removeprefix(".")) for path, _ in stack.values()]


# Export sometimes names a module reached through a sliced ModuleList by the slice (Llama's
# ``self.layers[: self.config.num_hidden_layers]``): "layers.slice(None, 2, None).1" is "layers.1".
_SLICE = re.compile(r"\.slice\((None|\d+), (None|-?\d+), (None|\d+)\)\.(\d+)(?=\.|$)")


def _unslice(path: str) -> str:
    """``path`` with each slice of a ModuleList resolved to the index in the list itself."""
    def index(match: re.Match) -> str:
        start, _, step, i = (None if g == "None" else int(g) for g in match.groups())
        return f".{(start or 0) + i * (step or 1)}"

    return _SLICE.sub(index, path)


def _module_path(node: torch.fx.Node) -> str:
    """The path of the innermost module an op was called in ("" for the model itself)."""
    stack = _module_stack(node)
    return stack[-1] if stack else ""


def _batch_symbols(shape) -> set:
    return {s for d in shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}


def _batch_dims(shape, batch_symbol) -> int:
    """How many dims of ``shape`` hold the batch (its symbol, alone or in a product: B, B*T)."""
    return sum(isinstance(d, torch.SymInt) and batch_symbol in d.node.expr.free_symbols for d in shape)


# Ops that take a tensor for its dtype and device alone (Funnel's ``inputs_embeds.new_ones([T, T])``): their
# output may lack the batch dim without mixing its rows.
_READS_NO_VALUES = {torch.ops.aten.new_ones.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
                    torch.ops.aten.new_full.default, torch.ops.aten.new_empty_strided.default}


def _mixes_rows(node: torch.fx.Node, batch_symbol) -> bool:
    """An op whose tensor input carries the batch dim but whose float output has lost it, or holds it in more dims
    than any input does: a product of rows by rows (CLIP's texts by its images, ``(B, D) @ (D, B)``), where each
    member's rows would meet every member's."""
    if "batch_norm" in str(node.target):  # args: input, weight, bias, mean, var, training, ...
        return "no_training" not in str(node.target) and len(node.args) > 5 and node.args[5] is True
    if node.target in _READS_NO_VALUES:  # ``x.new_ones(shape)``: x's dtype and device only, none of its rows
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        return False
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    batched = [_batch_dims(t.shape, batch_symbol) for t in inputs if isinstance(t, torch.Tensor)]
    held = _batch_dims(out.shape, batch_symbol)
    return any(batched) and (held == 0 or held > max(batched))


def _unbatched_input(node: torch.fx.Node, weights: set[str], batch_symbol) -> bool:
    """An op on a parameter whose other tensor inputs lead with a dim that is neither 1 nor the batch:
    a wide layer would split those rows into members. ``weights``: the nodes computed from parameters and
    buffers alone (a weight-norm parametrization's weight), which are no inputs."""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if arg.name in weights or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        first = val.shape[0]
        if not (isinstance(first, int) and first == 1) and batch_symbol not in _batch_symbols(val.shape[:1]):
            return True
    return False


def _unbatched_uses(node: torch.fx.Node, batch_symbol) -> set[str]:
    """Module paths of the ops that use ``node``'s result while it lacks the batch dim, and of the first
    ops after which it has it again (the model's output counts as the root module)."""
    paths, seen, frontier = set(), set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            paths.add(_module_path(user) if user.op != "output" else "")
            val = user.meta.get("val")
            if not (isinstance(val, torch.Tensor) and batch_symbol in _batch_symbols(val.shape)):
                frontier.append(user)
    return paths


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
        batch_symbol = next(iter(_batch_symbols(first_input.meta["val"].shape)), None)
    unbatched: dict[str, tuple[str, set[str]]] = {}
    callers: dict[str, set[str]] = defaultdict(set)
    param_names = _weight_nodes(program.graph, set(placeholders))
    escapes = _escapes(program.graph, batch_symbol) if batch_symbol is not None else {}
    takes = _takes(program.graph, batch_symbol, param_names) if batch_symbol is not None else {}
    for node in program.graph.nodes:
        stack = _module_stack(node)
        for caller, callee in itertools.pairwise(stack):
            callers[callee].add(caller)
        if node.op == "placeholder" and node.name in placeholders:
            fqn = placeholders[node.name].removeprefix("model.")
            for user in node.users:
                path = _module_path(user)
                users[fqn].add(path)
                own = path == (fqn.rsplit(".", 1)[0] if "." in fqn else "")
                if (own and batch_symbol is not None and path not in unbatched
                        and _unbatched_input(user, param_names, batch_symbol)):
                    unbatched[path] = (str(user.target), _unbatched_uses(user, batch_symbol))
        elif node.op == "call_function" and batch_symbol is not None and _mixes_rows(node, batch_symbol):
            path = _module_path(node)
            mixing.setdefault(path, str(node.target))
    if batch_symbol is None:
        method, roles = "export (static batch)", {}
        notes.append("the batch dim was specialised by export, so ops that mix batch rows were not checked")
    return Trace(method, dict(users), mixing, notes, unbatched, dict(callers), escapes, takes, roles)


def _escapes(graph: torch.fx.Graph, batch_symbol) -> dict[str, set[str]]:
    """For every module, the leading dims of the tensors that leave its calls (see :attr:`Trace.escapes`)."""
    found: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        kind = _leading(val, batch_symbol)
        inside = _module_stack(node)
        for user in node.users:
            reached = set(_module_stack(user)) if user.op != "output" else set()
            for path in inside:
                if path not in reached:
                    found[path].add(kind)
    return dict(found)


def _leading(val: torch.Tensor, batch_symbol) -> str:
    """What a tensor's leading dim is: "batch", "one" (a broadcast, or a result without the batch dim) or "other"."""
    first = val.shape[0]
    return ("batch" if batch_symbol in _batch_symbols(val.shape[:1])
            else "one" if isinstance(first, int) and first == 1 else "other")


def _takes(graph: torch.fx.Graph, batch_symbol, weights: set[str]) -> dict[str, set[str]]:
    """For every module, the leading dims of the tensors its calls read from outside it (see :attr:`Trace.takes`);
    ``weights``: the nodes computed from parameters and buffers alone, which are no inputs."""
    found: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inside = _module_stack(node)
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg.name in weights or not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            kind = _leading(val, batch_symbol)
            made = set(_module_stack(arg)) if arg.op != "placeholder" else set()
            for path in inside:
                if path not in made:
                    found[path].add(kind)
    return dict(found)


def _weight_nodes(graph: torch.fx.Graph, params: set[str]) -> set[str]:
    """The names of the nodes computed from parameters and buffers alone (at least one, and no model input):
    the parameters themselves and weights derived from them (weight norm's ``g * v / |v|``)."""
    from_params, from_inputs = set(params), set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in params:
                from_inputs.add(node.name)
            continue
        names = {a.name for a in node.all_input_nodes}
        if names & from_inputs:
            from_inputs.add(node.name)
        elif names & from_params:
            from_params.add(node.name)
    return from_params


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
