"""The sharded (zero stage 2/3) training step when a forward or backward raises on some ranks:
what keeps the others from waiting in FSDP's collectives (and, with tensor parallelism, in
the tp group's).

FSDP2 all-gathers each unit's parameters in the forward (and, at zero stage 3, again in the
backward) and reduce-scatters each unit's gradients after its backward, every rank making the
same blocking collectives in the same order. A rank whose forward or backward raised stops
making them, so every other rank would wait in the next one until the process group's
timeout. Here a rank whose forward raised runs the all-gathers of the units it did not reach
(:meth:`FsdpReplay.after_forward_failure`; the other ranks then raise at the loss, which hears
of the failure), and a rank whose backward raised runs the rest of FSDP's backward itself,
with zeros for the gradients it did not compute (:meth:`FsdpReplay.after_failure`), through
FSDP's own per-unit methods in FSDP's order: each unit's pre-backward (its all-gather and the
prefetch of the next) for the units whose outputs need a gradient, its reduce-scatter right
after where its inputs need one (FSDP's post-backward hook), and the remaining reduce-scatters
in the order of FSDP's final callback (a parameter that holds no gradient gets zeros where
:meth:`FsdpReplay.reduces` says the others reduce it: as the agreement before the backward
found, ``grad_agreement``, else as its layer's last reduce-scatter had it). What is done is
read from what happened, not from FSDP's per-unit state alone: each unit's post-backward is
counted when it returns or, when it raised, if the process group's collective count moved
during it (FSDP marks a unit done before its reduce-scatter, so an error there, before it
sends, would otherwise look complete; its final callback sets units back to idle). After
every backward the ranks all-reduce a status vector in which a rank whose backward raised
marks itself (then, where one did, the start of its error): the others raise RingPeerError
instead of stepping on invalid gradients (:meth:`FsdpReplay.after_success`).
``booster.reset()`` then resets FSDP's per-iteration state and drops gradients accumulated
under ``no_sync`` (:meth:`FsdpReplay.reset`).

With tensor parallelism (tp > 1) each decoder layer's blocks also make blocking collectives
on the tp group (``tp_replay.TpReplay`` lists them), and FSDP's post-backward sums the
partial-sum gradients over tp (``_get_grad_inner_tensor``) before its reduce-scatter. A rank
whose forward or backward raised makes both kinds in the one order every rank makes them
(two ranks that made them in different orders would each wait for the other): per unit its
all-gather, the tp collectives of its blocks this rank did not make (from the tp group's
collective count), then its post-backward, on zeros that are partial sums over tp where the
other ranks' gradients are (so FSDP sums them over tp as theirs). A post-backward that raised
after some of its sums over tp cleared the gradients it summed: the replay gives those
replicated zeros, so only the sums it did not make are made. The status vector goes over all
ranks: a failed rank's tp peers are in other FSDP groups.

Not replayed (the rank's error gets a note, the others wait in FSDP's collectives, and the
plugin's reset refuses on this rank): a backward of more than one forward (FSDP then gathers
each unit once per use); with tp, whatever ``TpReplay`` notes it cannot list (the first
backward with checkpointed layers, a second backward of one forward, a failure before the
input embedding saw the batch, blocks that do not each run once per forward or run outside
the decoder layers). Not reproduced: FSDP's explicit prefetching
(``set_modules_to_backward_prefetch``), which the plugin does not set.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._common_utils import collect_grad_tensors
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor, Partial

from .._dist import collective_count, ring_timeout
from ..parallel.fsdp import HeldGrads
from .completion import Completion, agree_on_status, bounded, peers_failed_error

__all__ = ["FsdpReplay"]


class _Unit:
    """What the forwards did with one FSDP unit: ``gathered`` / ``posted``, the number of the
    last forward that ran its pre-forward (its all-gather) / its post-forward; as set by the
    last forward with gradients: ``inputs_need_grad``: FSDP registered its
    post-backward hook (the reduce-scatter right after its backward); ``outputs_need_grad``:
    FSDP registered its pre-backward hook (the all-gather and prefetch before it)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.groups = module._get_fsdp_state()._fsdp_param_groups
        self.gathered = self.posted = -1
        self.inputs_need_grad = self.outputs_need_grad = False


class FsdpReplay(Completion):
    """FSDP's collectives for a rank whose forward or backward raised, and the status check of
    the ranks whose backward ended, for one boosted model (see the module doc).

    ``units``: the FSDP modules in forward order, the root first. ``group``: FSDP's process
    group (the dp x sp ranks). ``tp``: with tensor parallelism (tp > 1), the model's
    ``TpReplay``, whose collectives on the tp group this one interleaves with FSDP's (its own
    completion is not registered), else None."""

    def __init__(self, units: List[nn.Module], group, tp=None):
        self.units = [_Unit(u) for u in units]
        self.group = group
        self.tp = tp
        # (with tp the tp peers of a failed rank are in other FSDP groups: they hear over W)
        self._status_group = dist.group.WORLD if tp is not None else group
        #: the unit that runs each tp block (the innermost), by the block's id
        self._unit_of = {}
        for block in (tp.blocks if tp is not None else []):
            inner = [u for u in self.units[1:]
                     if any(m is block.module for m in u.module.modules())]
            if not inner and tp.irregular is None:  # (its place among FSDP's is not known)
                tp.irregular = ("the tensor-parallel block of " + type(block.module).__name__
                                + " runs outside the decoder layers (FSDP's units)")
            self._unit_of[id(block)] = inner[0] if inner else self.units[0]
        self._tp_made = {}            # id of a group -> the tp collectives its post-backward made
        self._raised: Set[int] = set()  # id of each group whose post-backward raised unsent
        #: the ids of the FSDPParams that had no gradient (unused in the forward: FSDP leaves
        #: them out of its reduce-scatter) at the last post-backward of their group that
        #: reduced, outside a replay, while they required one
        self._unused: Set[int] = set()
        self._replaying = False
        self.expecting = False
        self._forward = 0           # forwards started
        self._grad_forwards = 0     # forwards with gradients since the last backward
        self._reduced: Set[int] = set()  # id of each group whose post-backward returned
        self._in_backward = False   # a backward reached the output of the last grad forward
        self._output_hooked = False  # the current forward's output needs a gradient
        for unit in self.units:
            for group_ in unit.groups:
                # (an instance attribute: FSDP's hook and final callback call it by name)
                group_.post_backward = self._counted(group_, group_.post_backward)
            # after FSDP's own hooks (prepended to the pre-forward, appended before this one
            # to the post-forward): the all-gather happened, the backward hooks are set
            unit.module.register_forward_pre_hook(
                lambda _m, args, kwargs, unit=unit: self._pre_forward(unit, args, kwargs),
                with_kwargs=True)
            unit.module.register_forward_hook(
                lambda _m, _args, out, unit=unit: self._post_forward(unit, out))

    def _counted(self, group, post_backward):
        # (the number of collectives made on FSDP's process group, where torch counts them)
        def collectives():
            return collective_count(self.group)

        def counted(*args):
            before, tp_before = collectives(), self._tp_count()
            # (what FSDP's reduce-scatter leaves out, seen where it reduces: a call under
            # no_sync, or one of a group that already returned in this backward, does not)
            record = not self._replaying and group.reduce_grads and id(group) not in self._reduced
            seen, unused = self._params_unused(group) if record else (None, None)
            try:
                out = post_backward(*args)
            except BaseException:
                if before is not None and collectives() != before:
                    self._reduced.add(id(group))  # it raised after sending its reduce-scatter
                else:
                    self._raised.add(id(group))
                self._tp_made_by(group, tp_before)
                raise
            self._reduced.add(id(group))  # (sent, or nothing to send: no_sync)
            self._tp_made_by(group, tp_before)
            if record:  # (one frozen now keeps its record: it may be unfrozen unused)
                self._unused = (self._unused - seen) | unused
            return out
        return counted

    has_grad = staticmethod(HeldGrads.holds)

    def reduces(self, fsdp_param) -> bool:
        """A completion of the backward (after a failure) reduces ``fsdp_param``'s gradient
        (zeros where it holds none): it requires one, and holds one or did not go without one
        at its group's last reduction (FSDP leaves out one unused in the forward)."""
        leaf = getattr(fsdp_param, "_unsharded_param", None)  # (set at the first forward)
        return (leaf is not None and leaf.requires_grad
                and (self.has_grad(fsdp_param) or id(fsdp_param) not in self._unused))

    def set_reduces(self, fsdp_param, reduced: bool) -> None:
        """Makes the completion reduce ``fsdp_param``'s gradient, or leave it out (what the
        ranks agreed before the backward, ``grad_agreement``)."""
        (self._unused.discard if reduced else self._unused.add)(id(fsdp_param))

    @staticmethod
    def _params_unused(group):
        """``(seen, unused)``: the ids of the group's gathered FSDPParams that require a
        gradient, and of those among them that have none now."""
        seen, unused = set(), set()
        for fsdp_param in group.fsdp_params:
            if not (hasattr(fsdp_param, "_unsharded_param")
                    and fsdp_param.unsharded_param.requires_grad):
                continue
            seen.add(id(fsdp_param))
            if not FsdpReplay.has_grad(fsdp_param):
                unused.add(id(fsdp_param))
        return seen, unused

    def _tp_count(self) -> Optional[int]:
        """The tp group's collective count (None without tp)."""
        return self.tp.collectives() if self.tp is not None else None

    def _tp_made_by(self, group, before: Optional[int]) -> None:
        if before is not None:  # (FSDP sums the partial-sum gradients over tp first)
            self._tp_made[id(group)] = self._tp_made.get(id(group), 0) + self._tp_count() - before

    # -- forward ---------------------------------------------------------------------------
    def _pre_forward(self, unit: _Unit, args, kwargs) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a checkpointed forward recomputed in the backward
        unit.gathered = self._forward
        if torch.is_grad_enabled():  # (a forward under no_grad sets no backward hook)
            unit.inputs_need_grad = bool(collect_grad_tensors((args, kwargs)))

    def _post_forward(self, unit: _Unit, out) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        unit.posted = self._forward
        if torch.is_grad_enabled():
            tensors = collect_grad_tensors(out)
            unit.outputs_need_grad = bool(tensors)
            if unit is self.units[0]:
                for t in tensors:  # the backward reached this model, not another one only
                    t.register_hook(self._backward_began)
                self._output_hooked = bool(tensors)

    def _backward_began(self, grad):
        self._in_backward = True
        return grad

    def forward_started(self) -> None:
        self._forward += 1
        self._reduced.clear()
        self._tp_made.clear()
        self._raised.clear()
        self._output_hooked = False
        if self.tp is not None:
            self.tp.forward_started()

    def backward_started(self) -> None:
        if self.tp is not None:
            self.tp.backward_started()

    def backward_ended(self) -> None:
        if self.tp is not None:
            self.tp.backward_ended()

    def reached(self) -> bool:
        return self.tp is not None and self.tp.reached()

    def reached_by(self, leaves: set, hidden: bool) -> bool:
        # (after a zero-3 forward the graph accumulates into FSDP's unsharded parameters,
        # not the sharded ones model.parameters() lists)
        return super().reached_by(leaves, hidden) or any(
            id(getattr(fp, "_unsharded_param", None)) in leaves
            for u in self.units for g in u.groups for fp in g.fsdp_params)

    def forward_ran(self) -> None:
        """A forward whose output needs a gradient waits for its backward (one under no_grad,
        or of a frozen model, leaves the wait as it was)."""
        if self.tp is not None:
            self.tp.forward_ran()
        if self._output_hooked:
            self.expecting, self._in_backward = True, False
            self._grad_forwards += 1

    def after_forward_failure(self, timeout: float) -> Optional[str]:
        """The rest of FSDP's forward: the all-gathers of the units this rank's forward did
        not reach and the post-forward of those it did not finish (resharded or kept as FSDP
        keeps them, and recorded in FSDP's forward order, which a backward that follows
        prefetches by), the root's last, as it wraps the others; with tp, each unit's tp
        collectives not made yet between its all-gather and its post-forward."""
        root, layers = self.units[0], self.units[1:]
        remaining = []  # (block, collective): the forward's tp collectives this rank did not make
        if self.tp is not None:
            note = self.tp.forward_note()
            if note:
                return note
            remaining = self.tp.forward_ops()[self.tp.forward_done():]

        def gather(group) -> None:
            group.unshard()
            group.wait_for_unshard()

        def finish(unit: _Unit) -> None:
            if unit.posted == self._forward:
                return
            if unit.gathered != self._forward:
                for group in unit.groups:
                    with group.use_training_state(TrainingState.FORWARD):
                        gather(group)
            for block, op in remaining:
                if self._unit_of[id(block)] is unit:
                    op()
            for group in unit.groups:
                with group.use_training_state(TrainingState.FORWARD):
                    group.reshard()
                    group._record_post_forward()
                group._training_state = TrainingState.IDLE

        def replay():
            if root.gathered != self._forward:
                for group in root.groups:
                    gather(group)
                root.gathered = self._forward
            for unit in layers:
                finish(unit)
            finish(root)
        return bounded(replay, self._groups(), timeout, "FSDP's forward")

    # -- backward --------------------------------------------------------------------------
    def after_failure(self, timeout: float, error: BaseException) -> Optional[str]:
        """The rest of FSDP's backward (the all-gathers, prefetches and reduce-scatters the
        other ranks make, on zeros where this rank has no gradient), then this rank marked in
        the status vector (then the exchange of ``error``)."""
        if not self.expecting:
            return self.tp.second_backward_note() if self.tp is not None else None
        self.expecting = False
        forwards, self._grad_forwards = self._grad_forwards, 0
        tp_note = self.tp.backward_note() if self.tp is not None else None
        if forwards > 1:
            return (f"ringseq: FSDP's backward was not completed for the other ranks: it "
                    f"follows {forwards} forwards (FSDP gathers each layer once per use), "
                    f"and they wait in its collectives")
        if tp_note:
            return tp_note
        root, layers = self.units[0], self.units[1:]
        ops = self.tp.backward_ops() if self.tp is not None else []  # (block, collective)
        done = self.tp.backward_done() if self.tp is not None else 0  # (tp ones made)
        made = 0  # the tp collectives of the backward up to where the replay is
        visited = set()  # id of each group whose post-backward the replay went past

        def tp_collectives(unit: _Unit) -> None:  # the unit's blocks', in the backward's order
            nonlocal made
            for block, op in ops:
                if self._unit_of[id(block)] is unit:
                    if made >= done:
                        op()
                    made += 1

        def post_backward(group) -> None:  # (its sums over tp, then its reduce-scatter)
            nonlocal made
            if id(group) in visited:  # (FSDP's final callback visits every group)
                return
            visited.add(id(group))
            if self._sent(group) or id(group) in self._raised:
                made += self._tp_made.get(id(group), 0)  # (those it made before it raised)
            if self._sent(group):
                return
            if made < done:
                raise RuntimeError(f"the tp collectives made ({done}) do not fit FSDP's "
                                   f"backward ({made} before an unsent reduce-scatter)")
            before = self._tp_count()
            self._post_backward(group)
            if before is not None:
                made += self._tp_count() - before

        def replay():
            if root.outputs_need_grad:
                for group in root.groups:
                    self._pre_backward(group)
            for i in range(len(layers) - 1, -1, -1):
                unit = layers[i]
                if not unit.outputs_need_grad:
                    continue
                for group in reversed(unit.groups):
                    self._pre_backward(group)
                    if i > 0 and len(unit.groups) == 1 and self._untouched(layers[i - 1]):
                        # FSDP's pre-backward prefetches the layer before it; an error there
                        # (its all-gather out of memory) leaves it unsent (else: a no-op)
                        FSDPParamGroup._prefetch_unshard(layers[i - 1].groups[-1], "backward")
                tp_collectives(unit)
                if unit.inputs_need_grad:
                    for group in reversed(unit.groups):
                        post_backward(group)
            # FSDP's final callback: the reduce-scatters not sent yet, in its order
            for state in root.module._get_fsdp_state()._state_ctx.all_states:
                for group in reversed(state._fsdp_param_groups):
                    post_backward(group)
            self._status(error)
        self._replaying = True
        try:
            return bounded(replay, self._groups(), timeout, "FSDP's backward")
        finally:
            self._replaying = False

    def _groups(self) -> list:
        """The process groups a replay makes collectives on."""
        if self.tp is None:
            return [self.group]
        return [self.group, self.tp.group, self._status_group]

    def after_success(self) -> None:
        """Raises RingPeerError when another rank's backward did not end (its gradients are
        zeros in this rank's sums). One all-reduce of W int64 per backward
        (``completion.agree_on_status``; one more after a failure)."""
        if self.tp is not None:
            self.tp.ended()  # (the order of its collectives, for a later failure)
        if not (self.expecting and self._in_backward):
            return  # (a backward of another model only)
        self.expecting, self._grad_forwards, self._in_backward = False, 0, False
        failed = self._status(None)
        if failed:
            raise peers_failed_error(failed)

    def _sent(self, group) -> bool:
        """The group's post-backward returned in this backward (its reduce-scatter was sent,
        or under no_sync it had none to send); one that raised before sending has not."""
        return id(group) in self._reduced

    def _begun(self, group) -> bool:
        """The group began its backward in this one (FSDP's state, or its post-backward
        counted: FSDP's final callback sets finished groups back to idle)."""
        return (group._training_state in (TrainingState.PRE_BACKWARD,
                                          TrainingState.POST_BACKWARD)
                or self._sent(group))

    def _untouched(self, unit: _Unit) -> bool:
        return not any(self._begun(group) for group in unit.groups)

    def _pre_backward(self, group) -> None:
        if not self._begun(group):
            group.pre_backward(True)  # gathers and prefetches as FSDP does

    def _post_backward(self, group) -> None:
        if self._sent(group):
            return
        for fsdp_param in group.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):
                continue
            param = fsdp_param.unsharded_param
            if self.reduces(fsdp_param) and not self.has_grad(fsdp_param):
                # (one the others leave out gets none, as FSDP does: see reduces)
                param.grad = torch.zeros_like(param)  # the same sizes as the other ranks'
                info = fsdp_param._module_info
                if (self.tp is not None and id(group) not in self._raised
                        and self.tp.partial_sum(param, info.module, info.param_name)):
                    # (a partial sum over tp, as the other ranks': FSDP sums it over tp; a
                    # post-backward that raised made the sums of the gradients it cleared)
                    param.grad = DTensor.from_local(
                        param.grad.to_local(), param.device_mesh,
                        [Partial()] * param.device_mesh.ndim, run_check=False)
        group.post_backward()

    def _status(self, error: Optional[BaseException]) -> Dict[int, str]:
        """The status all-reduce over FSDP's group (with tp: over all ranks), this rank marked
        when ``error`` is given, then the errors' exchange where a rank is
        (``completion.agree_on_status``); returns the global ranks marked, with the start of
        their errors."""
        ranks = dist.get_process_group_ranks(self._status_group)
        device = self.units[0].module._get_fsdp_state()._device
        return agree_on_status(self._status_group, ranks, dist.get_rank(self._status_group),
                               device, error, ring_timeout())

    def reset_refusal(self) -> Optional[str]:
        root = self.units[0].module
        if hasattr(root, "reset_iter_state"):
            return None
        return (f"FSDP2 forgets a failed forward or backward through "
                f"FSDPModule.reset_iter_state, which torch 2.13 added; with torch "
                f"{torch.__version__} restart the processes from the last checkpoint")

    def reset(self) -> None:
        """FSDP forgets the failed forward or backward (its units resharded, their
        per-iteration state cleared) and the gradients accumulated under ``no_sync``, which
        FSDP's reset keeps (a step after it would add them to the next ones)."""
        root = self.units[0].module
        if root._get_fsdp_state()._is_root is not None:  # (FSDP initializes at the first forward)
            root.reset_iter_state()
        HeldGrads(root).drop()
        self.expecting, self._grad_forwards = False, 0
        if self.tp is not None:
            self.tp.reset()

