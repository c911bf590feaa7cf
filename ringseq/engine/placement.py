"""Where an attention call runs: a :class:`Placement` turns a spec and this rank's tensors into
``(out, lse)`` and back into gradients.

* :class:`LocalPlacement`: the block kernel on this rank's tensors (single-device attention,
  and the inner step of an all-to-all);
* :class:`RingPlacement`: the ring engine (:mod:`ringseq.engine.loops`) over a group, with a
  layout;
* the sequence-parallel modes compose them (:mod:`ringseq.parallel`): Ulysses wraps any
  placement in two all-to-alls, the double ring is a ring whose block kernel is a lap of an
  inner ring.

The custom operator (:mod:`ringseq.engine.op`) takes a placement as a string
(:meth:`Placement.key`): the same placement of the same objects gives the same string, so a
compiled graph keeps one constant. Objects that cannot be strings (a process group, a user's
layout or transport) are named by :func:`object_key`, a weak process-local registry.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List

import torch

from .._dist import named_for, real_object
from ..kernels.grad import attention_backward, lse_grad_for
from ..kernels.registry import refuse_made_while_tracing
from ..layouts import LAYOUTS, Layout, layout_field
from ..layouts.base import _built_in
from ..spec import AttnSpec, check_user_layout, local_spans
from .loops import ring_backward, ring_forward
from .plan import make_plan
from .integrity import BWD, FWD
from .ring import get_ring, meet_as_failed, refuse_on_error

__all__ = ["LocalPlacement", "Placement", "RingPlacement", "object_by_key", "object_key",
           "placement_from_key", "register_placement", "ring_dout"]


# ------------------------------------------------------------------------------ object keys
_OBJECTS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # key -> object
# id(object) -> key, the entry dropped when the object dies: by identity, since a user's
# layout need not be hashable (a plain @dataclass is not) nor compare by identity
_KEYS: Dict[int, str] = {}
_IDS = itertools.count()


@torch.compiler.assume_constant_result
def object_key(obj, prefix: str) -> str:
    """A string naming ``obj`` in this process for as long as it lives (the same string for
    the same object). Under torch.compile it runs once at trace time (the compiled code
    guards on the object): registry lookups and inserts cannot be traced. (The real object
    of a tracing wrapper: one key for the same group in every trace.)"""
    obj = real_object(obj)
    key = _KEYS.get(id(obj))
    if key is None:
        refuse_made_while_tracing(obj, prefix)
        key = f"{prefix}#{next(_IDS)}"
        _OBJECTS[key] = obj
        _KEYS[id(obj)] = key
        weakref.finalize(obj, _KEYS.pop, id(obj), None)
    return key


def object_by_key(key: str, what: str):
    obj = _OBJECTS.get(key)
    if obj is None:
        raise RuntimeError(f"ringseq: the {what} of this attention call no longer exists "
                           f"({key}); keep it alive until the backward has run")
    return obj


def layout_key(layout: Layout) -> str:
    # A built-in layout by its name (a key stable across processes); a user's by the object,
    # registered or not: registering another under its name between a forward and its
    # backward made the backward run the other one's plan.
    if LAYOUTS.get(layout.name) is layout and _built_in(type(layout)):
        return layout.name
    return object_key(layout, "layout")


def layout_from_key(key: str) -> Layout:
    return LAYOUTS[key] if key in LAYOUTS else object_by_key(key, "layout")


def group_key(group) -> str:
    return "default" if group is None else object_key(group, "group")


def group_from_key(key: str):
    return None if key == "default" else object_by_key(key, "process group")


# ------------------------------------------------------------------------------- placements
class Placement:
    """How an attention call is distributed (see the module doc).

    ``forward(q, k, v, spec) -> (out, lse, saved)``: out (b, s_q, h, d) in q's dtype, lse
    (b, h, s_q) in the accumulation dtype, ``saved`` a list of tensors the backward needs
    besides q, k, v, out and lse. ``backward(dout, dlse, q, k, v, out, lse, saved, spec) ->
    (dq, dk, dv)``; ``dout`` / ``dlse`` may be None (no gradient reached them).
    ``saved_like(q, k, v, spec)``: fake tensors shaped like ``saved`` (for tracing).
    ``backward_reads_inputs``: whether ``backward`` reads the values of q, k, v (False: only
    their shapes, and the operator does not keep them alive)."""

    backward_reads_inputs = True

    def key(self) -> str:
        raise NotImplementedError

    def forward(self, q, k, v, spec: AttnSpec):
        raise NotImplementedError

    def backward(self, dout, dlse, q, k, v, out, lse, saved: List[torch.Tensor], spec: AttnSpec):
        raise NotImplementedError

    def saved_like(self, q, k, v, spec: AttnSpec) -> List[torch.Tensor]:
        return []

    def check_before_call(self, spec: AttnSpec, s_local: int) -> None:
        """What this placement refuses of a call with ``s_local`` tokens per rank here, run
        by a placement wrapping it (Ulysses around a ring) before its own call opens: a
        user's layout (:func:`ringseq.spec.check_user_layout`). Checked only inside, after
        the all-to-all, a refusal failed the whole call and broke the group. Default:
        nothing."""

    def join_failed(self, kind: int) -> None:
        """Called by a placement wrapping this one (Ulysses around a ring) instead of
        forward/backward on a rank whose call already failed: a placement with calls of its
        own meets its peers' begin there (they raise instead of waiting); local does nothing."""

    #: the layout of the ring dimension (ring placements), else None
    layout = None

    def refusal_group(self):
        """What :func:`ringseq.engine.ring.get_ring` takes for the ring that hears this rank's
        refusal of a call before its begin collective (a process group, None for the default
        group), or :data:`NO_RING` for a placement without one (local attention). A placement
        that opens ring calls overrides it, else a refusal on one rank leaves its peers
        waiting for the ring timeout."""
        return NO_RING

    def signature_fields(self) -> tuple:
        """``(name, value[, kind])`` fields that a placement wrapping this one (Ulysses around
        a ring) adds to its own call's signature, so that the ranks of the whole group agree
        on them before any byte moves: this placement's ring layout, if it has one."""
        return (() if self.layout is None else
                (layout_field("ring layout", self.layout),))


class LocalPlacement(Placement):
    """The block kernel on this rank's tensors: the spec's spans (windows, documents) or its
    causal flag, and its soft-cap. A spec with a window and neither spans nor documents
    (``flash_attn_func``'s) gets its window's span here, from the tensors' lengths at run
    time: built at the call, from the lengths as Python ints, it fixed the length of a call
    traced with a symbolic one (``torch.export``'s default, non-strict tracing)."""

    def key(self) -> str:
        return "local"

    @staticmethod
    def _with_spans(spec, q, k):
        if spec.spans is not None or spec.documents is not None:
            return spec
        # (flash-attn's kernels clamp a window side at seqlen_k: one at least that wide is none)
        return local_spans(spec, q.shape[1], k.shape[1], window_clamp=k.shape[1])

    def forward(self, q, k, v, spec):
        spec = self._with_spans(spec, q, k)
        out, lse = spec.backend.run_fwd(q, k, v, spec.softmax_scale,
                                        spec.causal and spec.spans is None, spans=spec.spans,
                                        softcap=spec.softcap)
        return out, lse, []

    def backward(self, dout, dlse, q, k, v, out, lse, saved, spec):
        spec = self._with_spans(spec, q, k)
        dlse = lse_grad_for(spec.backend, dlse)
        if dlse is not None and not spec.backend.supports_delta:
            try:
                spec.backend.require_lse_grad()
            except RuntimeError as exc:  # named for the function called, as the ring names it
                raise named_for(spec.fn, exc) from None
        return attention_backward(spec.backend, q, k, v, out, lse, spec.softmax_scale,
                                  spec.causal and spec.spans is None, dout, dlse,
                                  spans=spec.spans, softcap=spec.softcap)


LOCAL = LocalPlacement()


#: what :meth:`Placement.refusal_group` returns for a placement without a ring
NO_RING = object()


class RingPlacement(Placement):
    """The ring engine over ``group`` (None: the default group; a process group, a
    :class:`ringseq.engine.transport.Transport` or a Ring) with ``layout`` (bound to the
    call's documents inside); exchanges are counted as ``comm_kind``."""

    def __init__(self, layout: Layout, group=None, comm_kind: str = "ring"):
        self.layout, self.group, self.comm_kind = layout, group, comm_kind

    def refusal_group(self):
        return self.group

    def key(self) -> str:
        return f"ring|{layout_key(self.layout)}|{group_key(self.group)}|{self.comm_kind}"

    def _plan(self, q, k, spec):
        ring = get_ring(self.group)
        layout = self.layout.bind(spec.documents)
        plan = make_plan(spec, layout, ring.world_size, ring.rank, q.shape, k.shape[2],
                         q.dtype, self.comm_kind)
        return plan, ring

    def join_failed(self, kind: int) -> None:
        meet_as_failed(self.group, kind)

    def check_before_call(self, spec: AttnSpec, s_local: int) -> None:
        check_user_layout(spec, self.layout.bind(spec.documents),
                          get_ring(self.group).world_size, s_local)

    def forward(self, q, k, v, spec):
        # What runs before the call opens fails (an out-of-memory error, say) as this rank's
        # refusal of the call, so the peers raise instead of waiting in their begin collective.
        with refuse_on_error(self.group, FWD):
            plan, ring = self._plan(q, k, spec)
        call = ring.control_count  # (which its backward names: loops.backward_signature)
        out, lse = ring_forward(q, k, v, plan, ring)
        return out.to(q.dtype), lse, [torch.tensor(call, dtype=torch.int64)]  # ()

    def backward(self, dout, dlse, q, k, v, out, lse, saved, spec):
        with refuse_on_error(self.group, BWD):
            plan, ring = self._plan(q, k, spec)
            dout = ring_dout(dout, dlse, out, spec)
        # The backward names its forward: ranks running the backwards of two alike calls in
        # another order (same shapes and tag) raise instead of pairing them.
        return ring_backward(dout, q, k, v, out, lse, plan, ring, dlse, forward=int(saved[0]))

    def saved_like(self, q, k, v, spec):
        return [torch.empty((), dtype=torch.int64)]


def ring_dout(dout, dlse, out, spec: AttnSpec) -> torch.Tensor:
    """The upstream gradient as the ring's backward takes it: zeros when none reached ``out``,
    its last dimension contiguous (the ring's backward refuses a gradient into lse its backend
    cannot take before the call opens, meeting the peers' begin, so that every rank raises)."""
    if dout is None:
        return torch.zeros_like(out)
    # (an empty dout of an expanded gradient keeps stride 0 through .contiguous())
    if dout.stride(-1) == 1:
        return dout
    return dout.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------- from keys
_PARSERS: Dict[str, callable] = {}


def register_placement(kind: str, parse) -> None:
    """``parse(fields: list[str]) -> Placement`` rebuilds placements whose key starts with
    ``kind|`` (the sequence-parallel modes register theirs)."""
    _PARSERS[kind] = parse


def placement_from_key(key: str) -> Placement:
    """The placement :meth:`Placement.key` encoded. ValueError for a string no placement made
    (the operator called by hand); RuntimeError for an object of it that no longer exists."""
    kind, _, rest = key.partition("|")
    if kind == "local":
        return LOCAL
    try:
        if kind == "ring":
            lay, grp, comm_kind = rest.split("|")
            return RingPlacement(layout_from_key(lay), group_from_key(grp), comm_kind)
        parse = _PARSERS[kind]
    except (KeyError, ValueError):
        raise ValueError(f"ringseq::attention: placement must be a key made by a placement's "
                         f"key() ('local', 'ring|layout|group|kind', or one of "
                         f"{sorted(_PARSERS)} followed by its fields), got {key!r}") from None
    return parse(rest)
