"""Where a fallback runs: the module around a planned fallback that runs its members, and why it must run member
by member (a loop) rather than as one vmapped call. Helpers of :mod:`hf_wide.planner`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from .plan import Demotions
from .primitives.fallback import token_rows
from .registry import find_rewrite
from .structure import Opaque


def is_under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def common_ancestor(paths: Sequence[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def rewriting_ancestor(path: str, modules: dict[str, nn.Module], demoted: dict[str, str]) -> str | None:
    """The innermost module around ``path`` with a registered rewrite (:mod:`hf_wide.rewrites`), unless
    verification moved it down."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        candidate = ".".join(parts[:depth])
        if find_rewrite(modules[candidate]) is not None and candidate not in demoted:
            return candidate
    return None


def unbatched_root(path: str, uses: set[str], escapes: dict[str, set[str]]) -> str:
    """Where to run per member a module that runs its tensors on an input without the batch dim: the innermost
    module around it that hands on only batched results or broadcasts ``(1, ...)`` (T5's attention, whose
    position bias leaves it as (1, H, T, T): run per member, it leaves with a member dim, N*B rows), and at
    the latest the common ancestor of it and every use of its result."""
    outermost = common_ancestor([path, *uses])
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        candidate = ".".join(parts[:depth])
        if candidate == outermost or escapes.get(candidate, {"other"}) <= {"batch", "one"}:
            return candidate
    return outermost


def rows_root(path: str, escapes: dict[str, set[str]], takes: dict[str, set[str]]) -> str:
    """Where to run a module no builder takes: itself, unless it takes no input at all and hands on a broadcast
    (Swin's position bias of shape (1, H, L, L), made from its table alone and added to the attention of each
    image's windows: run alone, it would be expanded to the forward's N*B rows, not the N*B*W its attention has at
    other image sizes than the sample's): then the innermost module around it that takes the rows, which runs it
    per member on them. (A module that takes a broadcast, as rotary embeddings take positions (1, T), stays.)"""
    if not escapes or path in takes or "one" not in escapes.get(path, set()):
        return path
    parts = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:depth])
        if "batch" in takes.get(candidate, set()):
            return candidate
    return path


def loop_reason(root: str, modules: dict[str, nn.Module], opaque: dict[str, Opaque], demotions: Demotions,
                 member_modules: list[dict[str, nn.Module]]):
    """(why, own code): why the fallback at ``root`` must run member by member rather than vmap member 0's code
    over the stacked tensors (None if it need not), and whether each member must run its own module (its code
    differs from member 0's, or member 0's code over its tensors disagreed with it)."""
    if root in demotions.own_code:
        return demotions.own_code[root], True
    inside = next((path for path, o in opaque.items() if is_under(path, root) and not o.vectorisable), None)
    if inside is not None:
        return f"{inside or '(model)'} must run as each member's own code ({opaque[inside].reason})", True
    differing = shape_differs(root, member_modules)
    if differing is not None:
        return f"{differing} differs in shape between members (LoRA ranks): each member's own module", True
    if root in demotions.looped:
        return demotions.looped[root], False
    routed = next((p for p, m in modules.items() if is_under(p, root) and token_rows(m)), None)
    if routed is not None:
        return f"{routed} routes tokens to experts by their values (data-dependent control flow)", False
    return None, False


STAND_IN = "_hf_wide_stand_in"  # marks the empty tensor a stand-in member holds where it differs (hf_wide.loading)
_MISSING = object()


def shape_differs(root: str, member_modules: list[dict[str, nn.Module]]) -> str | None:
    """The first tensor under ``root`` whose shape differs between members (which cannot be stacked), or None. A
    stand-in's tensor has no shape of its own (the streaming loader checked the files' shapes against member 0's)."""
    shapes = [{n: None if getattr(t, STAND_IN, False) else t.shape
               for n, t in (*m[root].named_parameters(), *m[root].named_buffers())} for m in member_modules]
    return next((f"{root}.{n}" if root else n for n, s in shapes[0].items()
                 if any(other.get(n, _MISSING) not in (s, None) for other in shapes[1:])), None)


def settle(root: str, modules: dict[str, nn.Module], callers: dict[str, set[str]]) -> str:
    """Where a fallback planned at ``root`` can run: a ModuleList has no forward of its own (its parent runs
    it), and a module whose submodules are also called from outside it (XMOD's layer calls
    ``self.output.LayerNorm`` itself) must fall back together with those callers: a fallback runs its
    members only where it is called itself."""
    while True:
        outside = {c for path, cs in callers.items() if path != root and is_under(path, root)
                   for c in cs if not is_under(c, root)}
        settled = common_ancestor([root, *outside]) if outside else root
        while settled and isinstance(modules[settled], (nn.ModuleList, nn.ModuleDict)):
            settled = settled.rpartition(".")[0]
        if settled == root:
            return root
        root = settled


def tied_to_own_code(roots: Sequence[str], own_code: Callable[[str], bool], aliases: dict[str, list[str]],
                     trained: set[str]) -> dict[str, str]:
    """The modules that must run as each member's own module because they hold a parameter to train (in
    ``trained``) tied to one that such a fallback holds, with the reason: a fallback root that would run from stacked
    tensors, or the holder's module itself. Each member's own module holds its own tensor, which a stacked tensor
    elsewhere cannot be: two tensors, which training would update apart (RecurrentGemma's lm_head is its
    embed_tokens, inside a model that keeps state and runs per member). Where both run as each member's own module,
    each member's two are one tensor again (:func:`hf_wide.swap.retie`). A frozen tensor's copies stay equal (a
    LoRA base's embeddings: its lm_head stays wide)."""
    found: dict[str, str] = {}
    for names in aliases.values():
        if not trained.intersection(names):
            continue
        holders = {name: next((r for r in roots if is_under(name.rpartition(".")[0], r)), None) for name in names}
        own = [name for name, root in holders.items() if root is not None and own_code(root)]
        if not own:
            continue
        for name, root in holders.items():
            if root is None or not own_code(root):
                found.setdefault(name.rpartition(".")[0] if root is None else root,
                                 f"{name} is {own[0]}, which runs as each member's own module")
    return found


def outermost_roots(fallback_roots: dict[str, str], modules: dict[str, nn.Module], callers: dict[str, set[str]],
                    aliases: dict[str, list[str]], loop_of: Callable[[str], tuple[str | None, bool]]
                    ) -> dict[str, tuple[str | None, bool]]:
    """The fallbacks a plan runs, outermost first, each with ``loop_of``'s (why it runs member by member, whether as
    each member's own module): every root of ``fallback_roots`` settled where it can run (:func:`settle`), those
    inside another left out, and a module tied to one run as each member's own module run so too
    (:func:`tied_to_own_code`; added to ``fallback_roots`` with the reason)."""
    trained = {f"{path}.{name}" if path else name for path, module in modules.items()
               for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    tied_own: dict[str, str] = {}
    while True:
        for root in list(fallback_roots):
            settled = settle(root, modules, callers)
            if settled != root:
                fallback_roots.setdefault(settled, fallback_roots.pop(root))
        outermost = []
        for root in sorted(fallback_roots, key=lambda p: (p.count(".") + bool(p), p)):
            if not any(is_under(root, kept) for kept in outermost):
                outermost.append(root)
        loops = {root: (tied_own[root], True) if root in tied_own else loop_of(root) for root in outermost}
        tied = {root: why for root, why in tied_to_own_code(outermost, lambda r: loops[r][1], aliases, trained).items()
                if root not in tied_own}
        if not tied:
            return loops
        tied_own.update(tied)
        for root in tied:
            fallback_roots.setdefault(root, "holds a tensor tied to a module that runs per member")
