"""What the exported graph of a trace says (:mod:`hf_wide.tracer`): the modules each op was called in, which ops
carry the batch's symbol and in how many dims, which mix rows of the batch, and which tensors each module's calls hand
on to code outside it, or take from it."""

from __future__ import annotations

import re
from collections import defaultdict

import torch

def module_stack(node: torch.fx.Node) -> list[str]:
    """The paths of the modules an op was called in, outermost first (the exported wrapper's prefix cut)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [unslice(path.removeprefix("model").removeprefix(".")) for path, _ in stack.values()]


# Export sometimes names a module reached through a sliced ModuleList by the slice (Llama's
# ``self.layers[: self.config.num_hidden_layers]``): "layers.slice(None, 2, None).1" is "layers.1".
_SLICE = re.compile(r"\.slice\((None|\d+), (None|-?\d+), (None|\d+)\)\.(\d+)(?=\.|$)")


def unslice(path: str) -> str:
    """``path`` with each slice of a ModuleList resolved to the index in the list itself."""
    def index(match: re.Match) -> str:
        start, _, step, i = (None if g == "None" else int(g) for g in match.groups())
        return f".{(start or 0) + i * (step or 1)}"

    return _SLICE.sub(index, path)


def module_path(node: torch.fx.Node) -> str:
    """The path of the innermost module an op was called in ("" for the model itself)."""
    stack = module_stack(node)
    return stack[-1] if stack else ""


def batch_symbols(shape) -> set:
    return {s for d in shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}


def batch_dims(shape, batch_symbol) -> int:
    """How many dims of ``shape`` hold the batch (its symbol, alone or in a product: B, B*T)."""
    return sum(isinstance(d, torch.SymInt) and batch_symbol in d.node.expr.free_symbols for d in shape)


# Ops that take a tensor for its dtype and device alone (Funnel's ``inputs_embeds.new_ones([T, T])``): their
# output may lack the batch dim without mixing its rows.
_READS_NO_VALUES = {torch.ops.aten.new_ones.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
                    torch.ops.aten.new_full.default, torch.ops.aten.new_empty_strided.default}


def mixes_rows(node: torch.fx.Node, batch_symbol) -> bool:
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
    batched = [batch_dims(t.shape, batch_symbol) for t in inputs if isinstance(t, torch.Tensor)]
    held = batch_dims(out.shape, batch_symbol)
    return any(batched) and (held == 0 or held > max(batched))


def unbatched_input(node: torch.fx.Node, weights: set[str], batch_symbol) -> bool:
    """An op on a parameter whose other tensor inputs lead with a dim that is neither 1 nor the batch:
    a wide layer would split those rows into members. ``weights``: the nodes computed from parameters and
    buffers alone (a weight-norm parametrization's weight), which are no inputs."""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if arg.name in weights or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        first = val.shape[0]
        if not (isinstance(first, int) and first == 1) and batch_symbol not in batch_symbols(val.shape[:1]):
            return True
    return False


def unbatched_uses(node: torch.fx.Node, batch_symbol) -> set[str]:
    """Module paths of the ops that use ``node``'s result while it lacks the batch dim, and of the first
    ops after which it has it again (the model's output counts as the root module)."""
    paths, seen, frontier = set(), set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            paths.add(module_path(user) if user.op != "output" else "")
            val = user.meta.get("val")
            if not (isinstance(val, torch.Tensor) and batch_symbol in batch_symbols(val.shape)):
                frontier.append(user)
    return paths


def escapes(graph: torch.fx.Graph, batch_symbol) -> dict[str, set[str]]:
    """For every module, the leading dims of the tensors that leave its calls (see :attr:`hf_wide.tracer.Trace.escapes`)."""
    found: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        kind = leading(val, batch_symbol)
        inside = module_stack(node)
        for user in node.users:
            reached = set(module_stack(user)) if user.op != "output" else set()
            for path in inside:
                if path not in reached:
                    found[path].add(kind)
    return dict(found)


def leading(val: torch.Tensor, batch_symbol) -> str:
    """What a tensor's leading dim is: "batch", "one" (a broadcast, or a result without the batch dim) or "other"."""
    first = val.shape[0]
    return ("batch" if batch_symbol in batch_symbols(val.shape[:1])
            else "one" if isinstance(first, int) and first == 1 else "other")


def takes(graph: torch.fx.Graph, batch_symbol, weights: set[str]) -> dict[str, set[str]]:
    """For every module, the leading dims of the tensors its calls read from outside it (see :attr:`hf_wide.tracer.Trace.takes`);
    ``weights``: the nodes computed from parameters and buffers alone, which are no inputs."""
    found: dict[str, set[str]] = defaultdict(set)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inside = module_stack(node)
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg.name in weights or not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            kind = leading(val, batch_symbol)
            made = set(module_stack(arg)) if arg.op != "placeholder" else set()
            for path in inside:
                if path not in made:
                    found[path].add(kind)
    return dict(found)


def weight_nodes(graph: torch.fx.Graph, params: set[str]) -> set[str]:
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
