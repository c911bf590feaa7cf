"""The agreement at the start of every ``booster.backward``: what keeps the ranks' gradient
reductions the same size (FSDP's reduce-scatters, the tensor-parallel sums over tp, the
zero-stage-0 tensor-parallel sync, DDP's buckets).

Two things decide which gradient collectives a backward makes, and both can differ between
ranks without any error of their own:

* whether the backward reduces at all (``booster.no_sync``): ranks that disagree would pair
  one rank's reduce-scatter or all-reduce with the others' next collective (gloo aborts a
  process on the size mismatch, or every rank waits for the process group's timeout);
* which parameters get a gradient: a parameter used on some ranks only (a branch that depends
  on the tokens, a mixture of experts' routing) is in the reduction of the ranks that used it
  only (FSDP and the tp sync leave out a parameter without a gradient).

Before the backward starts (no collective of it has run yet), every rank sends a hash of
whether each boosted model's gradients are reduced in this backward, a hash of which of their
parameters will have a gradient at the reduction (reached from the loss through the autograd
graph, or holding a gradient accumulated under ``no_sync``) and whether its graph holds a
reentrant checkpoint, and a hash of which parameters are frozen, in one control all-gather
on the default group (``Ring.agree``, ``about="backward"``; four fields for any number of
models). Ranks that froze different parameters (``requires_grad=False`` on some ranks only:
their reductions would leave them out) exchange the sets and raise ``RingMismatchError``
naming them, before any collective of the backward. Ranks that disagree on ``no_sync``
exchange each model's state (a second control all-gather, only then) and raise
``RingMismatchError`` on every rank, naming each rank's state, before any collective of the
backward. Ranks that disagree on the parameters exchange their sets (a second control
all-gather, only then) and every rank gives the parameters some other rank uses, and it does
not, a zero gradient (a partial sum over tp where the parameter is replicated over tp, as the
others' gradients are, by the failure replay's rule): the reductions then match and the
result is exact, as DDP's ``find_unused_parameters=True`` (a parameter no rank uses keeps no
gradient).

Not seen: a parameter used only inside a reentrant ``torch.utils.checkpoint`` region (its use
is hidden from the graph until the region is recomputed; every rank then reports it unused).
Only ``booster.backward`` runs the agreement (a bare ``loss.backward()`` does not), and only
with the consistency checks on (``set_consistency_check``): with them off, nothing is agreed
and a parameter used on some ranks only makes the reductions differ in size again.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from .._dist import RingMismatchError
from .._hash import stable_hash_ints
from ..engine.integrity import ANY, mismatch_error

__all__ = ["GradUse", "agree_before_backward", "graph_leaves"]

_HINT = ("Every rank must run the same micro-batches inside booster.no_sync(model) (the "
         "backward of each rank reduces its gradients, or none does); nothing was reduced, "
         "the gradients of this backward were not accumulated. Clear them "
         "(optimizer.zero_grad()) and redo the accumulation on every rank.")


def graph_leaves(loss: torch.Tensor) -> Tuple[set, bool]:
    """``(ids, hidden)``: the ids of the leaf tensors (parameters) a backward of ``loss``
    accumulates into (the variables of the autograd graph's AccumulateGrad nodes), and whether
    the graph holds a reentrant ``torch.utils.checkpoint`` region, whose parameters it does
    not show (they appear when the backward recomputes the region)."""
    root = getattr(loss, "grad_fn", None)
    leaves, seen, stack = set(), set(), [root] if root is not None else []
    hidden = False
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        hidden = hidden or type(fn).__name__ == "CheckpointFunctionBackward"
        var = getattr(fn, "variable", None)
        if var is not None:
            leaves.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves, hidden


def _zero_like(t: torch.Tensor, partial: bool) -> torch.Tensor:
    """A zero gradient for ``t``; ``partial``: for a DTensor, a partial sum (zeros) over each
    mesh dim ``t`` is replicated on, as the gradient of a parameter used on a share of the
    work of each rank (tensor parallelism: other tokens or heads) is (``TpReplay.partial_sum``
    decides, as for the failure replay's zeros)."""
    if partial and isinstance(t, DTensor):
        local = torch.zeros_like(t.to_local())
        placements = [Partial() if p.is_replicate() else p for p in t.placements]
        return DTensor.from_local(local, t.device_mesh, placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return torch.zeros_like(t)


class ReducedParam(NamedTuple):
    """One parameter a reduction may carry, as the agreement sees it."""
    name: str
    leaf: Optional[torch.Tensor]  # what the autograd graph accumulates into (None: frozen)
    has_grad: Callable[[], bool]  # holds a gradient already (accumulated under no_sync)
    give_zero: Callable[[], None]  # makes it hold a zero gradient
    # whether the completion of a rank that did not run the backward (its forward under
    # no_grad raised between the loss and the backward) reduces it, and what makes it reduce
    # it or not (the reduction's ``reduces`` / ``set_reduces``; None without a completion)
    replayed: Optional[Callable[[], bool]]
    set_replayed: Optional[Callable[[bool], None]]


class GradUse:
    """One boosted model's reduction, as the agreement sees it.

    ``sync_on()``: whether this backward reduces the gradients (not inside ``no_sync``).
    ``entries()``: a :class:`ReducedParam` per parameter the reduction may carry, in the same
    order on every rank (empty: parameters are not checked, e.g. DDP, whose
    ``find_unused_parameters`` does it). ``reduction``: what completes this model's
    collectives on a rank that failed (``DdpSum``, ``TpReplay``, ``FsdpReplay``), or None."""

    def __init__(self, name: str, sync_on: Callable[[], bool],
                 entries: Callable[[], list] = lambda: [], reduction=None):
        self.name, self.sync_on, self.entries = name, sync_on, entries
        self.reduction = reduction
        self.index = 0  # which of the plugin's boosted models (in boost order) this is
        #: the SUM reduction's count (``wrappers.ReducedGrads``, zero stage 0), or None, and
        #: the model's parameters (a callable), which tell whether a loss reaches the model
        self.reduced, self.parameters = None, lambda: ()

    @classmethod
    def for_ddp(cls, ddp: nn.parallel.DistributedDataParallel, reduction) -> "GradUse":
        # torch's DDP decides at the forward whether the backward reduces (it prepares the
        # reducer there): what counts is no_sync at the last forward with gradients, not at
        # the backward (before: a forward inside no_sync with its backward outside was taken
        # as summed, and every rank stepped with its own gradients)
        at_forward = [True]

        def record(module, args):
            if torch.is_grad_enabled():
                at_forward[0] = bool(ddp.require_backward_grad_sync)
        ddp.register_forward_pre_hook(record)
        return cls("DDP", lambda: at_forward[0], reduction=reduction)

    @classmethod
    def for_grad_sync(cls, grad_sync, model: nn.Module, tp=None) -> "GradUse":
        """``tp``: the model's ``TpReplay`` (None: a plan of ParallelStyle objects; every
        replicated parameter's zero is then a partial sum)."""
        names = {id(p): n for n, p in model.named_parameters()}

        def entries():
            out = []
            for p in grad_sync.params:
                def give_zero(p=p):
                    p.grad = _zero_like(p, tp is None or tp.partial_sum(p))
                out.append(ReducedParam(
                    names.get(id(p), "?"), p if p.requires_grad else None,
                    lambda p=p: p.grad is not None and p.requires_grad, give_zero,
                    None if tp is None else lambda p=p: tp.reduces(p),
                    None if tp is None else lambda yes, p=p: tp.set_reduces(p, yes)))
            return out
        return cls("the tensor-parallel gradient sync", lambda: bool(grad_sync.enabled),
                   entries, reduction=tp)

    @classmethod
    def for_fsdp(cls, model: nn.Module, replay=None) -> "GradUse":
        from torch.distributed.fsdp import FSDPModule

        from .fsdp_replay import FsdpReplay
        groups = [g for m in model.modules() if isinstance(m, FSDPModule)
                  for g in m._get_fsdp_state()._fsdp_param_groups]

        def sync_on():
            return all(g.reduce_grads for g in groups)

        def entries():
            out = []
            for g in groups:
                for fp in g.fsdp_params:
                    leaf = getattr(fp, "_unsharded_param", None)  # (set at the first forward)

                    def give_zero(leaf=leaf, info=fp._module_info):
                        tp = None if replay is None else replay.tp
                        leaf.grad = _zero_like(leaf, tp is None or tp.partial_sum(
                            leaf, info.module, info.param_name))
                    usable = leaf is not None and leaf.requires_grad
                    out.append(ReducedParam(
                        fp._param_fqn or "?", leaf if usable else None,
                        lambda fp=fp: FsdpReplay.has_grad(fp), give_zero,
                        None if replay is None else lambda fp=fp: replay.reduces(fp),
                        None if replay is None else lambda yes, fp=fp: replay.set_reduces(fp, yes)))
            return out
        return cls("FSDP", sync_on, entries, reduction=replay)


def agree_before_backward(ring, uses: Sequence[GradUse], loss,
                          completing=None) -> Optional[List[str]]:
    """The agreement of the module doc on ``ring`` (the default group's), before the backward
    of ``loss``. Raises RingMismatchError on every rank when the ranks disagree on no_sync;
    returns the names of the parameters given zero gradients on this rank (None: none).
    ``completing``: the reduction (``GradUse.reduction`` of one of ``uses``) this rank completes
    for the others without running the backward (``FailureReporter``; ``loss`` None). For its
    model this rank offers the parameters its completion reduces, and the completion then
    reduces those any rank has (zeros); for the other models, the gradients they hold, as a
    rank whose loss does not reach them would."""
    if not uses or not ring.checks_on:
        return None
    leaves, hidden = None, False
    skipped, sets = [], []  # per model: no_sync on; (entries, bits, replaying)
    frozen, frozen_names = [], []  # per parameter of the models that reduce: requires_grad off
    for use in uses:
        sync = use.sync_on()
        skipped.append(int(not sync))
        entries = use.entries() if sync else []
        frozen += [int(e.leaf is None) for e in entries]
        frozen_names += [e.name for e in entries]
        replaying = completing is not None and use.reduction is completing
        bits = None
        if entries and replaying:
            bits = [int(e.replayed()) for e in entries]
        elif entries:
            if leaves is None:
                leaves, hidden = (set(), False) if loss is None else graph_leaves(loss)
            bits = [int(e.leaf is not None and (id(e.leaf) in leaves or e.has_grad()))
                    for e in entries]
        sets.append((entries, bits, replaying))
    # Four fields for any number of models (a control vector holds 25): what differs is
    # exchanged afterwards, only where it does.
    flat = [b for _, bits, _ in sets for b in bits or ()]
    fields = [("booster.no_sync of each boosted model (hash)", stable_hash_ints(skipped), ANY),
              ("parameters with a gradient (hash)", stable_hash_ints(_packed(flat)), ANY),
              ("a reentrant checkpoint in the graph", int(hidden), ANY),
              ("frozen parameters (hash)", stable_hash_ints(_packed(frozen)), ANY)]
    rows = ring.agree(True, "", fields=fields, about="backward", called="booster.backward",
                      hint=_HINT)
    if rows is None:
        return None
    if len({row[0] for row in rows}) > 1:  # (every rank sees it)
        many = len(uses) > 1 or uses[0].index > 0
        named = [(f"booster.no_sync{f' of boosted model {use.index}' if many else ''} "
                  f"({use.name})", s, "bool") for use, s in zip(uses, skipped)]
        err = mismatch_error(ring, ring.gather_ints(skipped, "backward"), named,
                             "booster.backward", _HINT)
        if err is not None:  # (the states differ where their hashes do)
            raise err
    if len({row[3] for row in rows}) > 1:  # (every rank sees it)
        _refuse_frozen_on_some_ranks(ring, frozen, frozen_names)
    # (where a rank's graph hides parameters, "no rank has it" is not known)
    hidden = any(row[2] for row in rows)
    union = flat
    if len({row[1] for row in rows}) > 1:
        # the sets differ (every rank sees it): one more control all-gather, of the sets
        union = [max(column) for column in zip(*ring.gather_ints(flat, "backward"))]
    zeroed, start = [], 0
    for entries, bits, replaying in sets:
        if bits is None:
            continue
        anyones, start = union[start:start + len(bits)], start + len(bits)
        for entry, mine, anyone in zip(entries, bits, anyones):
            if entry.set_replayed is not None and (replaying or anyone or not hidden):
                # a completion of this backward (this rank's, or after a failure in it)
                # reduces (zeros for) exactly the parameters any rank has, not those of the
                # last reduction (one used for the first time, or no longer used)
                entry.set_replayed(bool(anyone))
            if anyone and not mine and (replaying or (completing is None
                                                      and entry.leaf is not None)):
                if not replaying:
                    entry.give_zero()
                zeroed.append(entry.name)
    return zeroed or None


def _refuse_frozen_on_some_ranks(ring, frozen: List[int], names: List[str]) -> None:
    """RingMismatchError on every rank, before any collective of the backward, naming the
    parameters frozen (``requires_grad=False``) on some ranks only: a reduction leaves a frozen
    parameter out, so the ranks' reduce-scatters / all-reduces would differ in size (before:
    gloo aborted a process)."""
    rows = ring.gather_ints(frozen, "backward")
    if rows is None:
        return
    differ = [j for j in range(len(frozen)) if len({row[j] for row in rows}) > 1]
    if not differ:  # (hashes of equal sets do not differ: never here)
        return
    j = differ[0]
    on = [r for r, row in enumerate(rows) if row[j]]
    off = [r for r, row in enumerate(rows) if not row[j]]
    shown = [names[i] for i in differ[:4]] + (["..."] if len(differ) > 4 else [])
    raise RingMismatchError(
        f"ringseq: booster.backward: parameter(s) {shown} are frozen (requires_grad=False) on "
        f"some ranks only ({names[j]}: frozen on rank(s) {on}, not on rank(s) {off}), so the "
        f"ranks' gradient reductions would differ in size. Freeze or unfreeze a parameter on "
        f"every rank alike, then clear the gradients (optimizer.zero_grad()) and call "
        f"booster.reset() on every rank (FSDP keeps the refused forward's gathered "
        f"parameters until then). Nothing was reduced; the gradients of this backward were "
        f"not accumulated.")


def _packed(bits: List[int]) -> List[int]:
    """The bits as 62-bit words (the hash input), with their count first."""
    words = [len(bits)]
    for start in range(0, len(bits), 62):
        word = 0
        for j, b in enumerate(bits[start:start + 62]):
            word |= b << j
        words.append(word)
    return words
