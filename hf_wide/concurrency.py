"""Which calls of wide models may run at once in one process.

transformers records attentions and hidden states (``output_hidden_states=True``) through one collector per process,
``transformers.utils.output_capturing._active_collector``: a ``ContextVar`` (one per thread) in eager code, but one
global that every thread shares while compiled code runs (dynamo cannot trace a ``ContextVar``). A compiled forward
that breaks its graph inside the model (a module run member by member, a first call in a new thread) reads that
global after the break, and an eager forward reads it whenever a compiled one has set it. Two threads then
collected each other's layers: ``hidden_states`` of 0, 2, 4 or 5 layers instead of 3, with exact logits beside them.

So each call of a wide model passes a :class:`CallGate` first, as a *compiled* call or not (``wide.compile()``, or
under ``torch.compile``: :func:`under_dynamo`) and as one that *records* outputs or not, and waits while a call it
could disturb runs:

- a compiled call that records runs alone;
- a compiled call waits for eager calls that record, and an eager call that records waits for compiled calls;
- any other calls run together, as before (eager calls that record keep their own ``ContextVar``).

``generate`` counts as compiled: transformers compiles its forward by itself there (a static cache on an
accelerator). A call made inside another call of the same thread (a pipeline's, ``generate``'s forward) passes
freely: it is the outer call's. Models outside hf-wide do not pass the gate; a plain transformers model recording
outputs beside a compiled one in another thread meets the same limit of transformers.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except ImportError:  # (torch's own, not public: without it, what is_compiling() sees)
    get_eval_frame_callback = None


def _compatible(a: tuple[bool, bool], b: tuple[bool, bool]) -> bool:
    """Whether calls of kinds ``a`` and ``b`` (compiled, records) may run at once."""
    (compiled_a, records_a), (compiled_b, records_b) = a, b
    if compiled_a and records_a or compiled_b and records_b:
        return False
    return not (compiled_a and records_b or compiled_b and records_a)


class CallGate:
    """Lets a call in once every call running is :func:`_compatible` with it (see the module's docstring)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._running: Counter[tuple[bool, bool]] = Counter()  # kind -> calls of that kind running
        self._depth = threading.local()  # calls this thread is inside

    @contextmanager
    def call(self, compiled: bool, records: bool):
        depth = getattr(self._depth, "value", 0)
        if depth:  # inside a call of this thread, which holds the gate
            self._depth.value = depth + 1
            try:
                yield
            finally:
                self._depth.value = depth
            return
        kind = (compiled, records)
        with self._changed:
            self._changed.wait_for(lambda: all(_compatible(kind, other) for other in self._running))
            self._running[kind] += 1
        self._depth.value = 1
        try:
            yield
        finally:
            self._depth.value = 0
            with self._changed:
                self._running[kind] -= 1
                if not self._running[kind]:
                    del self._running[kind]
                self._changed.notify_all()


def under_dynamo() -> bool:
    """Whether this call runs under ``torch.compile``'s frame evaluation (``torch.compile(wide)``, or a compiled
    function calling the wide model), though its own frame runs as Python: dynamo skips a frame it cannot trace (the
    gate's lock), and compiles the forward it calls. Seen by ``is_compiling()`` only while it traced: 185 of 200 such
    calls from threads passed the gate as eager ones."""
    return get_eval_frame_callback is not None and get_eval_frame_callback() is not None


GATE = CallGate()  # one per process, as transformers' collector is
