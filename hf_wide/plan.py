"""The WidePlan: what becomes of every module of the template that owns tensors.

The tracer produces it, the swap walk applies it, ``print(wide.plan)`` and ``hf-wide trace`` show it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter


class Kind(str, enum.Enum):
    BLOCK = "block"  # a fused block replaces a whole known sub-structure (attention, MLP)
    PRIMITIVE = "primitive"  # a wide leaf layer: stacked weights, batched kernel
    SHARED = "shared"  # identical in every member: one module, one copy in memory
    REWRITTEN = "rewritten"  # the template's module with a method that reads its wide children's stacked tensors
    VECTORISED = "vectorised"  # no builder: the module's own forward, vmapped over the members' stacked tensors
    FALLBACK = "fallback"  # a loop: member by member on its rows (its stacked tensors, or its own module)


# A loop's wide class: member 0's code over each member's stacked tensors in turn, or each member's own module
# (where the members' code differs: a hook, another class, an attribute).
STACKED_LOOP, OWN_CODE_LOOP = "VectorisedFallback", "PerMemberFallback"


@dataclasses.dataclass
class ModulePlan:
    fqn: str  # "" is the model itself
    module_class: str
    kind: Kind
    wide_class: str | None = None
    params: int = 0  # parameters of one member (whole subtree for a fallback)
    flops: int = 0  # FLOPs of one member's forward on the trace's sample input (subtree)
    reason: str = ""

    @property
    def name(self) -> str:
        return self.fqn or "(model)"


@dataclasses.dataclass
class Demotions:
    """What verification moved down the ladder (block, primitive, vectorised, loop over the stacked tensors, loop
    over the members' own modules), each fqn with the reason."""

    unfused: dict[str, str] = dataclasses.field(default_factory=dict)  # blocks, planned by their parts
    per_member: dict[str, str] = dataclasses.field(default_factory=dict)  # primitives and kept modules
    looped: dict[str, str] = dataclasses.field(default_factory=dict)  # vectorised modules, run in a loop
    own_code: dict[str, str] = dataclasses.field(default_factory=dict)  # loops over stacked tensors: own modules

    def add(self, plan: "WidePlan", failures: dict[str, str]) -> bool:
        """Move each failed module one strategy down; False if none could move."""
        moved = False
        for fqn, reason in failures.items():
            entry = plan.entries.get(fqn)
            kind = entry.kind if entry is not None else None
            what = f"{entry.wide_class if entry is not None and entry.wide_class else 'kept'} {reason}"
            if kind == Kind.FALLBACK and entry.wide_class == STACKED_LOOP:
                kind = "own code"
            elif kind == Kind.FALLBACK:  # even each member's own module fails on its rows: run its parent per member
                if not fqn:
                    continue
                fqn, what = fqn.rpartition(".")[0], f"{fqn}: {what}"
                kind = None
            table = {Kind.BLOCK: self.unfused, Kind.VECTORISED: self.looped, "own code": self.own_code}.get(
                kind, self.per_member)
            if fqn not in table:
                table[fqn] = what
                moved = True
        return moved


@dataclasses.dataclass
class WidePlan:
    num_members: int
    model_class: str
    entries: dict[str, ModulePlan]
    trace_method: str  # "export (dynamic batch)", "export (static batch)" or "module tree"
    sample_shape: str = ""
    total_flops: int = 0
    warnings: list[str] = dataclasses.field(default_factory=list)
    # fallback fqn -> {structure of a call's inputs: which inputs carry the batch}, as the trace saw them
    # (hf_wide.primitives.roles): a fallback's table or mask of N*B rows by chance is not cut into members' rows
    input_roles: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)

    def by_kind(self, kind: Kind) -> list[ModulePlan]:
        return [e for e in self.entries.values() if e.kind == kind]

    @property
    def fallbacks(self) -> list[ModulePlan]:
        """The modules that run as the members' own code: vectorised or in a loop."""
        return [e for e in self.entries.values() if e.kind in (Kind.VECTORISED, Kind.FALLBACK)]

    @property
    def loops(self) -> list[ModulePlan]:
        return self.by_kind(Kind.FALLBACK)

    def counts(self) -> Counter:
        return Counter(e.kind.value for e in self.entries.values())

    def summary(self) -> str:
        counts = self.counts()
        parts = ", ".join(f"{counts[k.value]} {k.value}" for k in Kind if counts[k.value])
        return f"{self.model_class} x {self.num_members} members: {parts} (traced by {self.trace_method})"

    def __str__(self) -> str:
        rows = [("module", "class", "becomes", "params", "MFLOPs", "note")]
        for e in self.entries.values():
            becomes = e.kind.value if e.wide_class is None else f"{e.kind.value}: {e.wide_class}"
            rows.append((e.name, e.module_class, becomes, f"{e.params:,}", f"{e.flops / 1e6:.3f}", e.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [self.summary()]
        if self.sample_shape:
            lines.append(f"FLOPs per member forward on {self.sample_shape}: {self.total_flops / 1e6:.3f} MFLOPs")
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + ("  " + r[5] if r[5] else ""))
        lines += [f"warning: {w}" for w in grouped_notes(self.warnings)]
        return "\n".join(lines)


def grouped_notes(notes: list[str]) -> list[str]:
    """``notes`` with those that say the same of several modules ("{path}: {reason}") as one line, where the first
    of them stood: a 32-layer model's reason for each layer's attention is one line, not 32."""
    paths: dict[str, list[str]] = {}  # reason -> the modules it is given for, in order
    for note in notes:
        path, sep, reason = note.partition(": ")
        if sep and path and " " not in path:
            paths.setdefault(reason, []).append(path)
    lines = []
    for note in notes:
        path, sep, reason = note.partition(": ")
        named = paths.get(reason, []) if sep and path and " " not in path else []
        if len(named) < 3:
            lines.append(note)
        elif path == named[0]:  # the group's line; the others' are in it
            lines.append(f"{path} (and {len(named) - 1} more modules, the last {named[-1]}): {reason}")
    return lines
