"""The vectorised fallback: a module no builder knows, every member in one call.

The members' tensors are stacked, ``(N, ...)``, in ``stacked`` (a copy of the module's structure, so they keep
their names), and a call runs the source module's own forward through ``torch.func.functional_call`` under
``torch.func.vmap`` over the member dim: member m sees its own rows ``(B, ...)`` of the folded ``(N*B, ...)``
inputs and its own tensors. Inputs without the batch dim (a broadcast ``(1, ...)``, T5's position bias table)
are the same for every member; outputs come back ``(N, b, ...)`` and are folded, a broadcast b == 1 expanded
to the B rows of the forward, so a result without the batch dim (T5's position bias) reaches the modules that
read it with a member dim.

No code per class, and one parameter tensor per source tensor, as in a primitive. Integer inputs that every
member shares (ids, masks) are handed over once, unbatched, as the source would see them: transformers reads the
values of a mask to skip it, which vmap cannot do on a batched tensor. Where vmap cannot run (a cache, whose
rows and state each member reads and extends, or data-dependent control flow on inputs that differ between
members) the same stacked tensors run member by member; a cache the module makes itself (asked for one, handed
none) leaves vmap with its tensors as outputs, folded into the cache's N*B rows. The plan chooses this for a
module only after verification saw it agree with its members; data-dependent control flow and ``.item()`` make
vmap raise there, and the module is then planned as a loop (``loop=True``: member 0's code over each member's
tensors in turn, still one tensor per source tensor). Only where the members' code differs (a hook, another class) does a loop hold each member's own module
(:class:`~hf_wide.primitives.fallback.PerMemberFallback`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache

from ..compare import device_lost
from ..fold import Fold, enter_member_code, leave_member_code
from . import member_cache
from .base import copy_module, meta_copy
from .code_state import FreshState, batchnorm_statistics, empty_caches, module_pairs, restore_apart, take_settings
from .fallback import is_own_method, per_member_method, run_per_member, token_rows
from .roles import rows_and_batched


def _rebuild(module: nn.Module, source: nn.Module, make: Callable[[torch.Tensor, str], torch.Tensor]) -> nn.Module:
    """``module`` (a structural copy of ``source``) with each of its tensors set to ``make(source_tensor, path)``;
    a tensor tied inside ``source`` stays one tensor."""
    made: dict[int, torch.Tensor] = {}
    mods = dict(module.named_modules())
    for path, sub in source.named_modules():
        for store in ("_parameters", "_buffers"):
            for name, t in getattr(sub, store).items():
                if t is not None:
                    if id(t) not in made:
                        made[id(t)] = make(t, f"{path}.{name}" if path else name)
                    getattr(mods[path], store)[name] = made[id(t)]
    return module


_TENSOR = object()  # marks where a member's output had a tensor


def _tensors(module: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name (a tied tensor under each of its names, or once)."""
    return {**dict(module.named_parameters(remove_duplicate=remove_duplicate)),
            **dict(module.named_buffers(remove_duplicate=remove_duplicate))}



def _kept(t: torch.Tensor) -> torch.Tensor:  # a saved tensor, kept as it is
    return t


def _autocasting(leaves: list) -> bool:
    """Whether autocast is on for the inputs' device: vmap's kernels do not follow it (a vmapped linear with a bias
    on CPU comes back in float32 where a member's own comes back in bfloat16; Whisper's attention then met keys of
    another dtype than its queries), so the members' code runs member by member."""
    device = next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), "cpu")
    return torch.is_autocast_enabled(device)


def refused_by_vmap(exc: RuntimeError) -> bool:
    """Whether vmap refused a member's code: its own errors name it, an op it has no batching rule for says so (an
    ``out=`` division in spectral norm's power iteration, which runs in training only), and ``tensor.tolist()`` on a
    batched tensor (JetMoe's router counts its experts' tokens so) finds no storage."""
    message = str(exc)
    return "vmap" in message or "Batching rule not implemented" in message or "doesn't have storage" in message


def copy_code_for_thread(model: nn.Module) -> None:
    """This thread's copy of the code of every vectorised module in ``model`` (and of the submodules they were asked
    for), made now: a compiled forward that made one broke its graph there, in every new thread."""
    for module in model.modules():
        if isinstance(module, VectorisedFallback):
            for fallback in (module, *module.__dict__.get("_submodule_views", {}).values()):
                fallback._code()


class VectorisedFallback(nn.Module):
    """N members of one module, run as one ``vmap`` of its own forward over their stacked tensors.

    Compiled (``torch.compile``), it runs its members one after another instead, each on its own rows and slice of the
    stacked tensors: vmap's batching rules fix sizes in the graph (T5's relative-position embedding the length, scaled
    dot-product attention the batch; Swin's window counts failed), so a graph was compiled for every batch size and
    length, and past dynamo's recompile limit the model ran eagerly. Member by member, the sizes stay symbolic. (A
    graph of fixed shapes, ``WideModel.compile(dynamic=False)``, keeps vmap: its graph is smaller and faster.)"""

    expands_broadcasts = True  # False where it is the whole model: its outputs go to the caller as they are

    def __init__(self, fold: Fold, proto: nn.Module, stacked: nn.Module, loop: bool = False):
        super().__init__()
        self.fold = fold
        self.stacked = stacked  # the source's structure, every tensor (N, ...)
        self.loop = loop  # member by member, never vmapped (the plan says why)
        object.__setattr__(self, "proto", proto)  # the source on the meta device: the forward's code; not a child
        # Asked once, not in the forward: torch.compile warned of the lru_cache it would read there on every compile
        self.token_rows = token_rows(proto)

    @classmethod
    def from_modules(cls, mods: Sequence[nn.Module], fold: Fold, loop: bool = False) -> "VectorisedFallback":
        if len(mods) != fold.num_members:
            raise ValueError(f"{cls.__name__} needs {fold.num_members} modules, got {len(mods)}.")
        per_member = [_tensors(m, remove_duplicate=False) for m in mods]

        def stack(t: torch.Tensor, name: str) -> torch.Tensor:
            value = torch.stack([tensors[name].detach() for tensors in per_member])  # (N, ...)
            return nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value

        return cls(fold, meta_copy(mods[0]), _rebuild(meta_copy(mods[0]), mods[0], stack), loop)

    @property
    def num_members(self) -> int:
        return self.fold.num_members

    def to_module(self, i: int, share: bool = False) -> nn.Module:
        """Member i as an ordinary module: its own storage, or (``share=True``) views into the stacked tensors."""
        tensors = _tensors(self.stacked, remove_duplicate=False)

        def take(t: torch.Tensor, name: str) -> torch.Tensor:
            value = tensors[name][i].detach()
            value = value if share else value.clone()
            return nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value

        return _rebuild(empty_caches(copy_module(self.proto)), self.stacked, take)  # (no cache of member 0's)

    def to_modules(self) -> list[nn.Module]:
        return [self.to_module(i) for i in range(self.num_members)]

    def __getattr__(self, name: str):
        # Model code reads attributes of its submodules (a weight's dtype or device): member 0's view answers. A
        # submodule answers as a fallback of its own over the same stacked tensors, so that calling it (XMOD calls
        # ``self.output.LayerNorm``) runs every member's.
        try:
            return super().__getattr__(name)
        except AttributeError:
            view = self._member_view()
            value = getattr(view, name)
            if is_own_method(value, view):  # a method of the source's class: every member's, on its rows
                views = [view, *(self.to_module(i, share=True) for i in range(1, self.num_members))]
                tokens = self.token_rows
                return per_member_method(self.fold, [getattr(v, name) for v in views], tokens)
            if not isinstance(value, nn.Module):
                return value
            views = self.__dict__.setdefault("_submodule_views", {})  # not children: no second state dict
            if name not in views:
                views[name] = VectorisedFallback(self.fold, getattr(self.proto, name),
                                                 getattr(self._modules["stacked"], name), self.loop)
            return views[name]

    def _member_view(self) -> nn.Module:
        view = self.__dict__.get("_view")
        if view is None:
            view = self.__dict__["_view"] = self.to_module(0, share=True)
        return view

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: without this thread's code copies and the member views, which a
        copy makes anew (a ``threading.local`` cannot be copied). The inputs' roles go with it: a copy called
        first at other sizes than the sample's could not tell them from the lengths."""
        return {k: v for k, v in super().__getstate__().items() if k not in ("_calls", "_view", "_submodule_views")}

    @property
    def input_roles(self) -> dict[str, list[bool | None]]:
        """Which of its inputs carry the folded rows (True), which do not (False), unknown (None), per structure of
        its inputs: the trace's, then what its calls taught it (:mod:`~hf_wide.primitives.roles`)."""
        return self.__dict__.setdefault("_roles", {})

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_view", None)  # its views would keep the old tensors
        self.__dict__.pop("_submodule_views", None)
        return super()._apply(fn, recurse)

    def _code(self) -> nn.Module:
        """This thread's copy of the source on the meta device: ``functional_call`` swaps the module's tensors
        for the call's, so two threads must not share one."""
        calls = self.__dict__.get("_calls")  # not setdefault: a new threading.local per call breaks compiled graphs
        if calls is None:
            calls = self.__dict__["_calls"] = threading.local()
        if not hasattr(calls, "proto"):
            calls.proto = copy_module(self.proto)
            calls.fresh = FreshState(calls.proto)  # what a call leaves in its attributes is taken back
            calls.pairs = module_pairs(calls.proto, self.stacked)
        take_settings(calls.pairs)  # (no child: what reaches the model's modules reaches stacked)
        return calls.proto

    def _after_call(self, output=None):
        """``output``, with what the call left in the code's plain attributes taken back (:mod:`.code_state`: a cache
        member 0's call filled was every member's); compiled, only in code that keeps state, apart from the graph."""
        fresh = self.__dict__["_calls"].fresh
        if not torch.compiler.is_compiling():
            fresh.restore()
        elif fresh.changed or fresh.keeps_containers:
            restore_apart(fresh)
        return output

    def _state(self) -> dict[str, torch.Tensor]:
        """name -> (N, ...), each tensor once: functional_call sets a tied tensor's other names itself."""
        return _tensors(self.stacked)

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        grad = torch.is_grad_enabled()
        if (self.loop or (grad and self.__dict__.get("loop_under_autograd"))
                or any(member_cache.is_cache(t) for t in leaves)  # a cache: each member appends to its rows
                or _autocasting(leaves)
                or (torch.compiler.is_compiling() and not self.fold.compiled_static)):  # see the class's docstring
            return self._loop(args, kwargs)
        if grad and "loop_under_autograd" not in self.__dict__:
            self.__dict__["loop_under_autograd"] = self._no_autograd_through_vmap(leaves, spec)
            if self.__dict__["loop_under_autograd"]:
                return self._loop(args, kwargs)
        statistics = batchnorm_statistics(self.stacked) if self.training else ()
        try:
            return self._vmap(leaves, spec)
        except RuntimeError as exc:
            if not refused_by_vmap(exc):
                raise
            # vmap refuses these inputs (data-dependent control flow on values that differ between members):
            # the same stacked tensors, member by member. Verification reads the note: on the sample, a refusal
            # puts the module in a loop, so that the plan says so.
            self.__dict__["vmap_refused"] = f"vmap refused: {str(exc).strip().splitlines()[0][:160]}"
            with torch.no_grad():
                for buffer, before in statistics:  # as they were before the call that vmap refused
                    buffer.copy_(before)
            return self._loop(args, kwargs)

    def _no_autograd_through_vmap(self, leaves: list, spec) -> bool:
        """Whether autograd cannot go through this module's vmap where it goes through each member's own call: a
        kernel chosen inside vmap is not differentiable (CPU flash attention in a mask to train: T5's position
        bias), or its backward fails batched (one that reads a value; CUDA's memory-efficient attention over a
        vmapped bias, "LSE is not correctly aligned"). Then, under autograd, the module runs member by member. Tried
        once, forward and backward, on the first call under autograd, apart from the call itself: under saved-tensor
        hooks of its own, since activation checkpointing counts the tensors a forward saves and would count those
        of a try (recomputed without it, the count differs: CheckpointError), with the random state put back, which
        checkpointing replays for the recomputation, on copies of the inputs (nothing it does reaches the call's
        inputs or their graph), and with gradients returned, not accumulated. Any other failure of the forward is
        the call's to meet."""
        accelerators = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")}
        device_type = next(iter(accelerators)).type if accelerators else "cuda"
        devices = [d.index or 0 for d in accelerators if d.type == device_type]
        copies = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                  for t in leaves]
        with torch.random.fork_rng(devices, device_type=device_type), saved_tensors_hooks(_kept, _kept):
            try:
                outputs = self._vmap(copies, spec)
            except RuntimeError as exc:
                return "is not differentiable with respect to" in str(exc)
            outputs = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            inputs = [t for t in (*self.stacked.parameters(), *copies) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not (outputs and inputs):
                return False
            try:
                torch.autograd.grad(outputs, inputs, [torch.ones_like(t) for t in outputs], allow_unused=True)
            except RuntimeError as exc:
                if device_lost(exc):
                    raise
                return True
        return False

    def _loop(self, args: tuple, kwargs: dict):
        state, code = self._state(), self._code()
        calls = [lambda *a, i=i, **k: self._after_call(functional_call(code, {n: t[i] for n, t in state.items()},
                                                                          a, k))
                 for i in range(self.num_members)]
        tokens = self.token_rows
        return run_per_member(self.fold, calls, tokens, args, kwargs, self.expands_broadcasts, self.input_roles)

    def _vmap(self, leaves: list, spec):
        state, code = self._state(), self._code()  # name -> (N, ...)
        n = self.num_members
        rows, batched = self._rows(leaves, spec)
        mapped, in_dims = [], [0]
        for t, folded in zip(leaves, batched):
            if folded and not isinstance(t, torch.Tensor):
                t, dim = t // n, None  # a size of the N*B rows (roles.is_rows_size): each member's B
            elif folded:
                t = t.view(n, rows // n, *t.shape[1:])  # (N, B, ...)
                if not (t.is_floating_point() or torch.compiler.is_compiling()) and torch.equal(t, t[:1].expand_as(t)):
                    t, dim = t[0], None  # ids or a mask every member shares: one (B, ...), as the source sees it
                else:
                    dim = 0
            else:
                dim = None  # a broadcast, an input without the batch dim, or not a tensor: the same for all
            mapped.append(t)
            in_dims.append(dim)
        structure = {}

        def member(member_state, *member_leaves):
            m_args, m_kwargs = pytree.tree_unflatten(list(member_leaves), spec)
            out_leaves, structure["spec"] = pytree.tree_flatten(functional_call(code, member_state, m_args, m_kwargs))
            structure["static"] = [_TENSOR if isinstance(t, torch.Tensor) else t for t in out_leaves]
            # A cache the module made (asked for one, handed none) holds its member's rows: they leave vmap too. One
            # the members could not share is left as it is, and fails loudly if it is used.
            made = [(t, member_cache.row_tensors(t)) for t in out_leaves
                    if isinstance(t, Cache) and not member_cache.unshareable(t)]
            structure["caches"] = [(cache, len(rows)) for cache, rows in made]
            return [t for t in out_leaves if isinstance(t, torch.Tensor)] + [r for _, rows in made for r in rows]

        randomness = "different" if self.training else "error"
        outer = enter_member_code()  # a loss a member computes in it is its own (hf_wide.losses)
        try:
            outs = iter(vmap(member, in_dims=tuple(in_dims), randomness=randomness)(state, *mapped))
        finally:
            leave_member_code(outer)
            self._after_call()
        out_leaves = [self._merge(next(outs), rows // n) if t is _TENSOR else t for t in structure["static"]]
        for cache, count in structure["caches"]:  # (N, B, ...) each -> the cache's N*B rows, member-major
            member_cache.set_row_tensors(cache, [self._merge(next(outs), rows // n) for _ in range(count)])
        return pytree.tree_unflatten(out_leaves, structure["spec"])

    def _rows(self, leaves: list, spec) -> tuple[int, list[bool]]:
        """This call's folded rows, and which inputs carry them: see :func:`~hf_wide.primitives.roles.rows_and_batched`
        (the roles the trace gave this module, and what its first call, at fusion, taught it: the one verification
        checked against the members; copies and fused repos keep them)."""
        return rows_and_batched(self.input_roles, self.fold.rows, self.num_members, leaves, spec)

    def _merge(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        """(N, b, ...) -> (N*B, ...) with this call's B (the fold has none when ``generate`` runs an encoder
        itself), a broadcast b == 1 expanded unless this is the whole model; a member's 0-dim output stays (N,)."""
        if y.dim() < 2:
            return y
        return self.fold.merge(y, batch) if self.expands_broadcasts else y.reshape(-1, *y.shape[2:])

    def extra_repr(self) -> str:
        loop = ", loop=True" if self.loop else ""
        return f"num_members={self.num_members}, source={type(self.proto).__name__}{loop}"
