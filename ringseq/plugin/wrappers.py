"""What ``Booster.boost`` hands back: the wrapped model, optimizer and criterion."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import threading
import weakref
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.amp.grad_scaler import OptState

from .._args import check_size_and_rank, given
from .._dist import (RingDesyncError, RingError, RingMismatchError, add_note, global_rank,
                     ring_timeout)
from ..engine.integrity import ANY, call_tag
from ..engine.ring import get_ring
from ..parallel.fsdp import reshard_gathered
from ..loss import RING_REPORT_WAITS, report_own_failure, sharded_cross_entropy
from ..spec import float_field
from .dataloader import INPUTS_EMBEDS_UNDER_TP
from .digest import batch_digest
from .grad_norm import local_norm_share, scale_, total_norm
from .precision import found_inf, mark_inf, overflowed, settle_scaler, update_due

__all__ = ["FailureReporter", "ModelWrapper", "OptimizerWrapper", "ReducedGrads",
           "SequenceParallelLoss", "StepTag"]

# Keys of a sharded batch that are targets for the criterion, not model inputs.
TARGET_KEYS = ("shift_labels",)
# What a step that raised on some ranks leaves (their votes carry it to the others).
_STEP_FAILED = ("in optimizer.step: the parameters of the ranks whose step raised were not "
                "updated, or only in part, while the others' were, so the model is no longer "
                "consistent over the ranks; load the last checkpoint on every rank "
                "(booster.load_model and booster.load_optimizer)")


class StepTag:
    """The step number the boosted model and optimizer tag their ring calls with (0: none):
    the number of the batch the boosted data loader handed out last (1, 2, ... over all
    epochs), so a rank that skipped a step cannot pair its calls with another step's
    (``ringseq.call_tag``)."""

    def __init__(self):
        self.value = 0


#: the refusal of transformers' checkpointing on top of the plugin's (boost, and a forward
#: after gradient_checkpointing_enable()): the outer recompute runs the inner one again, ring
#: exchanges included, and recomputes every layer twice
BOTH_CHECKPOINTINGS = (
    "transformers' gradient checkpointing is on in this {}, and the plugin's "
    "activation_checkpointing=True checkpoints every decoder layer already, keeping the "
    "attention's output so that the backward repeats no ring exchange; together every layer "
    "is recomputed twice and the ring runs again. Turn one off: "
    "model.gradient_checkpointing_disable(), or activation_checkpointing=False (after a "
    "refused forward, then booster.reset() on every rank)")


class ModelWrapper(nn.Module):
    """The boosted model: data-parallel wrapper + autocast around the user's model.

    ``forward(*args, **kwargs)`` drops the target keys of a sharded batch (``shift_labels``),
    so ``model(**batch)`` works with a batch of the plugin's data loader, and runs the wrapped
    module under the plugin's autocast. ``unwrap()`` returns the user's model (its parameters
    are this rank's shards, DTensors, under tensor parallelism or zero stage 2/3;
    ``booster.save_model`` writes the full, unsharded state dict).

    When the forward raises on one rank (a bad token id, an out-of-memory error), the other
    ranks must not be left waiting: the failure is reported to the ring peers when they may be
    inside a ring call (``Ring.report_failure``; their ring call raises RingBrokenError),
    FSDP's all-gathers or the tp group's collectives this rank did not reach are run
    (``fsdp_replay.FsdpReplay``, ``tp_replay.TpReplay``), then the
    failure is reported to the loss of every rank (:func:`ringseq.loss.report_step_failure`,
    on the control channel: their loss raises RingPeerError naming this rank). Where the loss
    is on another group than the ring and a ring report was sent (the ring peers may be past
    their ring calls, as in the first step, whose ring calls are not counted yet), the loss
    report goes first and says that a ring report waits; the ring peers take it at their
    loss (``FailureReporter.take_ring_reports``). A forward under no_grad ends with that
    agreement itself, over the ranks its collectives reach (``FailureReporter.forward_ended``:
    every rank at zero stage 2/3, the model replica's sp x tp ranks at zero stage 0): an
    evaluation without the plugin's loss raises on all of them too. The exception
    is re-raised on this rank; the ring stays broken until ``booster.reset()`` (or
    ``ringseq.reset_ring``) on every rank.
    """

    def __init__(self, module: nn.Module, precision, reporter: "FailureReporter" = None,
                 step: StepTag = None, reduced: "ReducedGrads" = None):
        super().__init__()
        self.module = module
        self._precision = precision
        self._reporter = reporter
        self._step = StepTag() if step is None else step
        self._reduced = reduced  # the reductions' count (ReducedGrads), reset by zero_grad
        #: the reduction that completes the other ranks' collectives when this rank's step
        #: raises (ddp_sum.DdpSum for the plugin's DDP, fsdp_replay.FsdpReplay for its FSDP,
        #: with or without tensor parallelism, tp_replay.TpReplay for its tensor parallelism
        #: at zero stage 0), else None
        self._reduction = None
        #: (name, parameter) frozen when boost set up the gradient sum (DDP, which leaves them
        #: out of it; every parameter for a model boosted frozen, a distillation teacher say,
        #: where no sum was set up): a forward that could train one of them is refused
        self.frozen_at_boost = ()
        #: (name, parameter) trainable when boost built DDP without find_unused_parameters,
        #: which waits for each one's gradient: a forward with one of them frozen is refused
        self.trained_at_boost = ()
        #: the tensor-parallel plan splits the sequence at the input embedding's output, which
        #: ``inputs_embeds`` would bypass: refused then
        self.needs_input_ids = False
        #: ... and a transformers model there numbers its tokens from the shortened sequence:
        #: a forward without position_ids is refused
        self.needs_position_ids = False
        #: ... into this many parts (tp_size; 1: no split): a shard of another length is
        #: refused before any collective
        self.tp_split = 1
        #: the plugin's activation checkpointing is on (transformers' on top is refused)
        self.checkpointed = False
        #: the dtypes of the model's floating-point parameters as boost sharded them (FSDP2
        #: swaps in its compute-dtype copies between a forward and its backward)
        self.param_dtypes = frozenset()
        #: a forward under no_grad ends with the agreement of the ranks its collectives reach
        #: (``FailureReporter.forward_ended``, over ``no_grad_group``)
        self.agrees_after_no_grad_forward = False
        #: a forward with gradients / under no_grad starts with the agreement on its inputs
        #: (:meth:`_agree_on_inputs`): set by boost where its first collective may be one
        #: that carries no call tag and no shapes (a tp, FSDP or DDP one), not a ring call
        self.agrees_before_forward = False
        self.agrees_before_no_grad_forward = False
        #: the global rank of the first member of this rank's tensor-parallel group where
        #: the plan splits the sequence at the embedding (None: tp_size 1, or a plan of the
        #: user's own styles): the ranks of one tp group must be given the same inputs
        self.tp_peers = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._reduced is not None:
            self._reduced.clear()
        # fp16: this model's optimizers forget the loss scaled before; gradients zeroed in
        # place (set_to_none=False) and made again by a plain backward are the same tensors,
        # and passed as scaled ones: a step applied 1/65536 of them
        scaler = getattr(self._precision, "scaler", None)
        if scaler is not None:
            mine = {id(p) for p in self.parameters()}
            for user in list(getattr(scaler, "_ringseq_users", ())):
                if any(id(p) in mine for group in user.optim.param_groups
                       for p in group["params"]):
                    user._forget_gradients()

    def _refuse_unfrozen(self, user: nn.Module) -> None:
        frozen = [n for n, p in self.trained_at_boost if not p.requires_grad]
        # (every one frozen: no bucket waits for a gradient, as in a backward to the inputs
        # of a frozen model, which DDP takes)
        if frozen and len(frozen) < len(self.trained_at_boost):
            raise ValueError(
                f"{type(user).__name__}: parameter(s) {frozen[:4]}"
                f"{' ...' if len(frozen) > 4 else ''} required gradients when boost built "
                f"DistributedDataParallel, which waits for each one's gradient before it sums "
                f"its bucket over the ranks, but are frozen now; freeze them before "
                f"booster.boost (boost a fresh model), unfreeze them, or pass "
                f"ddp_kwargs={{'find_unused_parameters': True}} to RingSequenceParallelPlugin")
        unfrozen = [n for n, p in self.frozen_at_boost if p.requires_grad]
        if not unfrozen:
            return
        names = f"{unfrozen[:4]}{' ...' if len(unfrozen) > 4 else ''}"
        if len(self.frozen_at_boost) == sum(1 for _ in user.parameters()):
            what = (f"boosted with every parameter frozen, so no gradient sum over the ranks was "
                    f"set up, but parameter(s) {names} require gradients now")
        else:
            what = (f"parameter(s) {names} were frozen when boost built DistributedDataParallel, "
                    f"which leaves them out of the gradient sum over the ranks (each rank would "
                    f"train its own copy), but require gradients now")
        raise ValueError(f"{type(user).__name__}: {what}; unfreeze them before booster.boost "
                         f"(boost a fresh model), or freeze them again")

    def _outside_inference_mode(self):
        """Under tensor parallelism a forward inside ``torch.inference_mode`` runs under
        no_grad instead: the plan's DTensor redistributions lay the outputs out otherwise
        there (the logits split over the batch or the vocabulary, not the sequence)."""
        if self.tp_split > 1 and torch.is_inference_mode_enabled():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.no_grad())
            return stack
        return contextlib.nullcontext()

    @torch.compiler.disable  # (host code on a process group: a compiled model runs it eagerly)
    def _agree_on_inputs(self, user: nn.Module, ids, kwargs, refusal) -> bool:
        """The agreement that starts a forward whose first collective may be a tensor-parallel,
        FSDP or DDP one (``agrees_before_forward`` / ``agrees_before_no_grad_forward``): one
        control all-gather before any collective of the forward, over the ranks the forward
        reaches (a training step's -- gradients on, the model in training mode -- the default
        group, where the loader and the loss agree; an evaluation's -- under no_grad, or in
        eval mode -- ``FailureReporter.no_grad_group``, so that evaluating on one
        data-parallel group at zero 0 stays possible). Unlike ring calls, those collectives
        carry neither the step's call tag nor the inputs' shapes: a rank a batch ahead (it
        skipped a step) or given a longer shard or other tokens than its tp peers aborted in
        gloo ("Received data size doesn't match expected size"), waited for the timeout, or
        trained on a mix of two batches (each tp rank keeps its own part of the sequence it
        was given). Raises on every rank: RingDesyncError where a rank is at another
        agreement or step (its control vector carries the call tag, the loader's batch
        number: a rank that fetched one batch more meets the others' forward with its
        loader's agreement), ``refusal`` on this rank and RingPeerError on the others, and
        RingMismatchError where the ranks of one tensor-parallel group were given inputs of
        other shapes or values (a digest of the model's batch inputs, ``batch_digest``).
        Returns whether it ran (not with the consistency checks off: nothing is then
        compared, and nothing costs)."""
        # (an evaluation with gradients on, in eval mode, agrees as one under no_grad: before,
        # it agreed over the default group, and on one data-parallel group alone it waited
        # for the timeout or paired with the other group's training step)
        step = torch.is_grad_enabled() and user.training
        if not (self.agrees_before_forward if step else self.agrees_before_no_grad_forward):
            return False
        group = None if step else self._reporter.no_grad_group
        ring = get_ring(group)
        try:
            if not ring.checks_on:
                return False
        except ValueError:  # (a malformed check mode: agree refuses it on every rank)
            pass
        fields = ()
        if self.tp_peers is not None:
            inputs = dict(kwargs)
            if torch.is_tensor(ids):
                inputs["input_ids"] = ids
            shape = next((tuple(t.shape[:2]) for t in (ids, kwargs.get("inputs_embeds"))
                          if torch.is_tensor(t) and t.dim() >= 2), (0, 0))
            ok = refusal is None
            fields = (("tensor-parallel group", self.tp_peers, ANY),
                      ("input rows", shape[0] if ok else 0, ANY),
                      ("input length", shape[1] if ok else 0, ANY),
                      ("input digest", batch_digest(inputs) if ok else 0, ANY))
        name = type(user).__name__
        try:
            rows = ring.agree(refusal is None, str(refusal), error=refusal, fields=fields,
                              about="forward inputs", called=f"{name} (boosted forward)")
        except RingDesyncError as exc:
            add_note(exc, f"ringseq: raised by {name}'s boosted forward, whose agreement "
                          f"carries the call tag: the number of the boosted loader's batch "
                          f"(tag {self._step.value} here); a rank at its loader's batch "
                          f"agreement there fetched another batch (it skipped a step). "
                          f"Bring every rank to the same batch: optimizer.zero_grad() and "
                          f"booster.reset() on every rank, then a new loader iteration "
                          f"(or load the loader's state) on every rank")
            raise
        if rows is not None and fields:
            self._check_tp_inputs(name, group, rows)
        return True

    @staticmethod
    def _check_tp_inputs(name: str, group, rows) -> None:
        """RingMismatchError (on every rank: each judges the same gathered rows) when the
        ranks of one tensor-parallel group were given inputs of other shapes or values."""
        groups = {}
        for r, (peers, rows_, length, digest) in enumerate(rows):
            groups.setdefault(peers, []).append((global_rank(group, r), rows_, length, digest))
        detail = []
        for members in groups.values():
            ranks = [m[0] for m in members]
            if len({m[1:3] for m in members}) > 1:
                detail.append(f"tensor-parallel ranks {ranks}: input_ids shapes " + ", ".join(
                    f"rank {m[0]}: ({m[1]}, {m[2]})" for m in members))
            elif len({m[3] for m in members}) > 1:
                detail.append(f"tensor-parallel ranks {ranks}: batch digests (input_ids, "
                              f"position_ids, ...) " + ", ".join(
                                  f"rank {m[0]}: {m[3]:#010x}" for m in members))
        if detail:
            raise RingMismatchError(
                f"{name} (boosted forward): the ranks of one tensor-parallel group were given "
                f"different inputs ({'; '.join(detail)}); expected the same batch on every "
                f"rank of a tensor-parallel group (each keeps its own part of the same "
                f"sequence shard: the boosted loader gives them one). Nothing ran; the "
                f"rings stay usable")

    def unwrap(self) -> nn.Module:
        m = self.module
        return m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m

    def forward(self, *args, **kwargs):
        for key in TARGET_KEYS:
            kwargs.pop(key, None)
        with call_tag(self._step.value):
            if self._reporter is None:
                with self._precision.autocast():
                    return self.module(*args, **kwargs)
            user = self.unwrap()
            # Refusals of what the model was boosted for, made before any collective and
            # outside the failure reporting, so that nothing needs repair (those of frozen or
            # unfrozen parameters, which a rank may make alone, fail the forward below): every
            # rank holds the same parameters, and the boosted loader refuses inputs_embeds under
            # tp on every rank at once. Where the forward starts with an agreement
            # (_agree_on_inputs) they are raised there, so a rank refusing alone (batches of
            # the user's own) makes the others raise RingPeerError; elsewhere here (and the
            # other data-parallel groups wait for the ring timeout).
            refusal, reported = None, False
            agrees = self.agrees_after_no_grad_forward and not torch.is_grad_enabled()
            ids = kwargs.get("input_ids", args[0] if args else None)
            if self.needs_input_ids and kwargs.get("inputs_embeds") is not None:
                refusal = ValueError(f"{type(user).__name__}: {INPUTS_EMBEDS_UNDER_TP}")
            elif self.needs_position_ids and kwargs.get("position_ids") is None and \
                    len(args) < 3:
                # the plan shortens the sequence at the embedding: the model would make
                # positions for a tp rank's part of its shard and fail in its rotary tables
                # with a bare shape error (before ringseq's own check of the positions)
                refusal = ValueError(f"{type(user).__name__}: position_ids are needed with "
                                     f"tp_size > 1 (the tensor-parallel plan splits the "
                                     f"sequence at the input embedding, so the model cannot "
                                     f"number the tokens itself); pass the batch's "
                                     f"position_ids (ringseq.shard_batch and the boosted "
                                     f"loader make them)")
            elif self.tp_split > 1 and torch.is_tensor(ids) and ids.dim() == 2 and \
                    ids.shape[1] % self.tp_split:
                # (before: refused inside the plan's split, after a forward's collectives
                # began, so that booster.reset() refused and the processes had to restart;
                # the other replicas hear of it at their loss)
                refusal, reported = ValueError(
                    f"{type(user).__name__}: a sequence shard of {ids.shape[1]} tokens "
                    f"cannot be split over tp_size={self.tp_split} ranks (the "
                    f"tensor-parallel plan splits it at the input embedding); its length "
                    f"must be a multiple of {self.tp_split} (the boosted loader's batches "
                    f"are)"), True
            # (raises on every rank where the agreement runs, the refusal included)
            if not self._agree_on_inputs(user, ids, kwargs, refusal) and refusal is not None:
                if reported:
                    self._reporter.report_refusal(refusal, agrees)
                raise refusal
            hf_recomputes = user.training and hf_checkpointing(user)  # (read once per forward)
            self._reporter.backward_calls_per_forward = 2 if hf_recomputes else 1
            if self._reduction is not None:
                self._reduction.forward_started()
            with self._reporter.watch("forward", self._reduction, agrees), \
                    self._precision.autocast(), self._outside_inference_mode():
                if (self.frozen_at_boost or self.trained_at_boost) and torch.is_grad_enabled():
                    # (inside the watch: a rank that froze or unfroze alone fails its forward,
                    # and its ring peers and the loss hear of it, instead of waiting for it)
                    self._refuse_unfrozen(user)
                if self.checkpointed and hf_recomputes and torch.is_grad_enabled():
                    # (enabled after boost; as transformers, which checkpoints only in training
                    # with gradients; inside the watch, as above)
                    raise ValueError(f"{type(user).__name__}: "
                                     f"{BOTH_CHECKPOINTINGS.format(type(user).__name__)}")
                out = self.module(*args, **kwargs)
        if self._reduction is not None:
            self._reduction.forward_ran()
        if self._reporter is not None and torch.is_grad_enabled():
            self._reporter.loss_ran = False
            self._reporter.backward_pending = True
        if self._reporter is not None and agrees:
            self._reporter.forward_ended()
        return out


class ReducedGrads:
    """How many backward passes summed the gradients over the ranks since the optimizer last
    stepped or cleared them.

    The plugin's replicated (zero stage 0) reduction is a SUM (exact for its global-mean loss),
    and a sum is not idempotent: a second reduced backward onto gradients that were already
    summed sums them again, W times too large, without any error (DDP's usual average would
    keep them). The reduction calls :meth:`mark` once per backward; the boosted optimizer's
    ``step`` calls :meth:`check_once` first, which raises ValueError (on every rank: ``step``
    agrees on its verdict before any rank steps) when more than one backward was reduced
    since the last step or clear, when a backward accumulated onto gradients the last step
    used (:meth:`watch`), when a ``booster.backward`` inside ``no_sync`` followed the
    reduced one (:meth:`unreduced_backward`: its gradients were never summed, and each rank
    would step with its own), or when every backward since the last step or clear ran inside
    ``no_sync`` (none summed; under FSDP, ``held``: FSDP still holds their gradients, which
    the optimizer does not see); the boosted optimizer's and model's ``zero_grad`` call
    :meth:`clear`, which also drops what FSDP holds."""

    def __init__(self):
        self.count = 0          # reduced backward passes since the gradients were cleared
        self.stepped = False    # the optimizer stepped on the gradients since they were cleared
        self.uncleared = False  # a backward accumulated onto gradients a step already used
        self._fresh = {}        # graph task -> its backward found the gradients cleared
        self._marked_task = None
        self.unreduced_after = False  # a backward inside no_sync followed the reduced one
        self.unreduced_only = False  # backward passes inside no_sync, none reduced after them
        self._unreduced_next = False  # the running backward (if any) runs inside no_sync
        self._probe_summed = False  # a summed backward reached the probe since the clear
        #: under FSDP (``ringseq.parallel.fsdp.HeldGrads``): the gradients it holds between
        #: backward passes inside no_sync, else None
        self.held = None
        #: ids of the parameters outside the boosted optimizer (:meth:`watch_outside`) whose
        #: gradient holds a summed backward's, and of those a summed backward summed again
        self._holding_summed, self.resummed = set(), set()

    def watch(self, params) -> None:
        """Sees how the gradients were left before each backward: a hook on the smallest
        parameter finds, before the backward accumulates into it, whether its gradient holds
        values (None or all zeros: cleared, whichever way -- the boosted optimizer, the user's
        own module, a loop setting ``p.grad = None``). A backward onto gradients a step used
        (a loop without zero_grad) is refused at the next step; a backward onto cleared
        gradients restarts the count. The probe is a parameter every rank holds whole where
        there is one (a tensor-parallel shard could be all zeros on one rank only, and the ranks
        would then disagree on refusing the step); reading its gradient costs one host
        synchronization per backward. A backward that does not reach the probe (its parameter
        unused in that step) is not seen by this check."""
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        whole = [p for p in params
                 if all(pl.is_replicate() for pl in getattr(p, "placements", ()))]
        probe = min(whole or params, key=lambda p: p.numel())

        def before_accumulate(grad, probe=probe):
            old = probe.grad
            local = old.to_local() if hasattr(old, "to_local") else old
            cleared = old is None or not bool(local.any())
            if not self._unreduced_next:
                self._probe_summed = True  # (it holds a gradient after this backward)
            elif old is None and self._probe_summed:
                # a backward inside no_sync onto gradients set to None since a summed one
                # reached the probe (the user's own module's zero_grad): that one no longer
                # counts. (Zeros are no such sign: a gradient may be zero itself.)
                self.count, self.unreduced_after, self.unreduced_only = 0, False, True
            if cleared:
                self.uncleared = False
                task = torch._C._current_graph_task_id()
                if self._marked_task == task:  # this backward's reduction came first
                    self.count = 1
                else:
                    self._fresh[task] = True
            elif self.stepped:
                self.uncleared = True
            self.stepped = False
            return grad

        probe.register_hook(before_accumulate)

    def watch_outside(self, params) -> None:
        """Watches the parameters the boosted optimizer does not step: its ``zero_grad``
        leaves their gradients, so a summed backward sums what they hold again (n·g0 + g1
        after two). Nothing steps on them until ``add_param_group`` adds one; the step then
        refuses one in :attr:`resummed` (:meth:`OptimizerWrapper.step`). A hook per such
        parameter reads, before the backward accumulates into it, whether its gradient holds
        values (one host synchronization where it is a tensor; none where it is None).
        (A summed backward right after backward passes inside no_sync may count as one
        of them for parameters it reaches before its reduction starts: not refused then.)"""
        for p in params:

            def before_accumulate(grad, key=id(p), p=p):
                old = p.grad
                local = old.to_local() if hasattr(old, "to_local") else old
                if old is None or not bool(local.any()):  # (cleared, whichever way)
                    self._holding_summed.discard(key)
                    self.resummed.discard(key)
                if not self._unreduced_next:  # (this backward sums what the gradient holds)
                    if key in self._holding_summed:
                        self.resummed.add(key)
                    self._holding_summed.add(key)
                return grad

            if p.requires_grad:
                p.register_hook(before_accumulate)

    def mark(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._fresh.pop(task, False):  # the probe saw cleared gradients in this backward
            self.count = 0
        self._fresh.clear()  # (entries of no_sync backward passes, which are not reduced)
        self.count += 1
        self._marked_task = task
        self.unreduced_only = self._unreduced_next = False  # (this reduction sums them too)

    def unreduced_backward(self) -> None:
        """Before a ``booster.backward`` inside ``no_sync`` (the plugin's agreement knows,
        the same on every rank): after a reduced one, its gradients will never be summed;
        before any, a reduced backward must still follow. Where the probe then finds the
        gradients cleared (the user's own module's ``zero_grad`` since the reduced one),
        the reduced one no longer counts (:meth:`watch`); a probe this backward does not
        reach (a parameter unused in it) leaves the refusal."""
        if self.count:
            self.unreduced_after = True
        else:
            self.unreduced_only = True
        self._unreduced_next = True

    def clear(self) -> None:
        self.count = 0
        self.stepped = self.uncleared = self.unreduced_after = self.unreduced_only = False
        self._unreduced_next = self._probe_summed = False
        if self.held is not None:
            self.held.drop()

    def after_step(self) -> None:
        self.count = 0
        self.stepped = True
        self.unreduced_after = self.unreduced_only = self._unreduced_next = False

    def unsummed(self) -> Optional[str]:
        """Why the gradients are not (all) summed over the ranks yet -- backward passes inside
        ``no_sync`` and no summing one after them -- or None."""
        if self.unreduced_after:
            return "a backward inside booster.no_sync(model) followed the one that summed them"
        if self.unreduced_only:
            # (under DDP the forward decides: a backward outside no_sync whose forward ran
            # inside it sums nothing either)
            return ("every backward since the last step or zero_grad ran inside no_sync (under "
                    "DDP: its forward did, which decides)")
        if self.held is not None and self.held.any():
            return "FSDP holds the gradients of backward passes inside no_sync, never reduced"
        return None

    def check_once(self) -> None:
        # The count stays: the gradients stay wrong until they are cleared (zero_grad).
        if self.uncleared:
            raise ValueError(
                "OptimizerWrapper.step: a backward added its gradients to gradients that the "
                "previous step already used, which the sum over the ranks had summed (W times "
                "too large once summed again); not stepping. Clear the gradients after every "
                "step (optimizer.zero_grad() or model.zero_grad())")
        if self.unreduced_after:
            raise ValueError(
                "OptimizerWrapper.step: a backward inside booster.no_sync(model) followed the "
                "backward that summed the gradients over the ranks, so its gradients were "
                "never summed and each rank would step with its own (the replicas would drift "
                "apart); not stepping. Run every micro-batch but the LAST inside no_sync; "
                "clear the gradients with optimizer.zero_grad() or model.zero_grad() before "
                "the next step")
        if self.unreduced_only:
            raise ValueError(
                "OptimizerWrapper.step: every backward since the last step or zero_grad ran "
                "inside booster.no_sync(model) (under DDP: its forward did, which decides), so "
                "no gradient was summed over the ranks "
                "(each rank would step with its own, and the replicas would drift apart); not "
                "stepping. Run the LAST micro-batch (its forward and backward) outside no_sync: "
                "its backward sums them all")
        if self.held is not None and self.held.any():
            # (whether a reduced backward came first or not: FSDP does not count them)
            raise ValueError(
                "OptimizerWrapper.step: FSDP holds gradients that were never reduced over the "
                "ranks (the optimizer would not see them, and they would go into the next "
                "step); not stepping. Either backward passes ran inside booster.no_sync(model) "
                "and the step's last micro-batch did too (run the LAST micro-batch outside "
                "no_sync: its backward reduces them all), or an earlier step raised and was "
                "not reset (after a failed step: optimizer.zero_grad() and booster.reset() on "
                "every rank). Clear the gradients with optimizer.zero_grad() or "
                "model.zero_grad() before the next step")
        if self.count > 1:
            raise ValueError(
                f"OptimizerWrapper.step: {self.count} backward passes summed the gradients over "
                f"the ranks since the last step or zero_grad, so the summed gradients of the "
                f"earlier ones were summed again (W times too large); not stepping. For gradient "
                f"accumulation run every micro-batch but the last inside booster.no_sync(model); "
                f"clear the gradients with optimizer.zero_grad() or model.zero_grad() (of the "
                f"boosted optimizer or model: they reset this count) before the next step")


def hf_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' own activation checkpointing is on in ``model`` (its newer name
    first: the older one warns that it is deprecated)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


def _join(thread: threading.Thread) -> Optional[KeyboardInterrupt]:
    """Waits for ``thread`` (a ring report, which gives up after the ring timeout) even through
    Ctrl-C, which it returns for the caller to raise once the other ranks are told: left
    running, the report would still hold the ring while the ring is reset."""
    interrupted = None
    while thread.is_alive():
        try:
            thread.join()
        except KeyboardInterrupt as exc:
            interrupted = exc
    return interrupted


_LOSS_GROUP = object()  # take_ring_reports' default: the reporter's loss_group


def _local(grad: torch.Tensor) -> torch.Tensor:
    # a DTensor's local shard: the same tensor object on every call (to_local() with
    # gradients enabled makes a new view each time)
    return getattr(grad, "_local_tensor", grad)


class FailureReporter:
    """Tells the other ranks that this rank's forward or backward raised, so none of them
    waits for it (see :class:`ModelWrapper`).

    ``watch(phase, reduction)`` is a context manager around a forward or a backward. On an
    exception that is not a ring error (ring errors are raised on every rank already), it
    reports to the ring peers when they may still be inside a ring call of this phase -- this
    rank made fewer ring calls than the last complete pass of the phase did --, completes the
    data-parallel collectives this rank did not reach (a forward's: ``reduction``'s; a
    backward's: those of the one boosted model waiting for it) and, for the forward, reports
    to the loss reduction that every rank of ``loss_group`` reaches next (first, marked, where
    a ring report may wait for ring peers already at their loss; they take it there:
    :meth:`take_ring_reports`). The exception propagates; a backward that ended checks the
    other ranks' status (``reductions``).
    """

    def __init__(self, ring, loss_group=None, device=None):
        self.ring, self.loss_group, self.device = ring, loss_group, device
        self._calls = {}  # phase -> ring calls of the last complete pass
        #: ring calls of a backward per ring call of its forward, for the first backward: 2
        #: under transformers' own gradient checkpointing, which runs each layer's attention
        #: again (the plugin's keeps the attention outputs: 1); set by ModelWrapper.forward
        self.backward_calls_per_forward = 1
        #: the reductions of the boosted models (``ddp_sum.DdpSum``,
        #: ``fsdp_replay.FsdpReplay``, ``tp_replay.TpReplay``): a step that raised completes
        #: their collectives, a
        #: backward that ended checks the peers' status
        self.reductions = []
        #: the plugin's loss ran since the last forward with gradients (set by
        #: SequenceParallelLoss, cleared by ModelWrapper.forward)
        self.loss_ran = False
        #: a forward with gradients ran since the last booster.backward (or the plugin's
        #: reset): the ranks go on to its loss and backward
        self.backward_pending = False
        #: why the other ranks wait in collectives this rank did not complete, or None
        self.unusable = None
        #: the agreement the others make before the backward this rank completes without
        #: running it (``grad_agreement``; set by the plugin; takes the reduction it
        #: completes), or None
        self.before_completion = None
        #: the ranks a forward reaches, which agree at the end of a forward under no_grad
        #: (``forward_ended``; set by the plugin; None: the default group)
        self.no_grad_group = None

    @contextlib.contextmanager
    def watch(self, phase: str, reduction=None, agreed_at_end: bool = False, loss=None):
        """``reduction``: for a forward, the boosted model's (the collectives this rank did
        not reach are completed while the ring report runs); a backward completes those of
        the one reduction that waits for it and that its ``loss`` reaches. ``agreed_at_end``:
        a forward under no_grad that every rank ends with :meth:`forward_ended`, where the
        loss report meets them."""
        before = self.ring.calls
        if phase == "backward":
            for reduction_ in self.reductions:
                reduction_.backward_started()
        try:
            try:
                yield
            except BaseException as exc:  # SystemExit too (a SIGTERM handler's sys.exit())
                if dist.is_initialized():
                    self._after_failure(phase, exc, self.ring.calls - before, reduction,
                                        agreed_at_end, loss)
                raise
            self._calls[phase] = self.ring.calls - before
            if phase == "backward":
                for reduction_ in self.reductions:
                    reduction_.after_success()  # RingPeerError: another rank's backward raised
        finally:
            if phase == "backward":
                self.backward_pending = False
                for reduction_ in self.reductions:
                    reduction_.backward_ended()

    def forward_ended(self) -> None:
        """After a forward under no_grad that ran on this rank: meets the ranks of
        ``no_grad_group`` where a rank whose forward raised sends its loss report
        (``_after_failure``). A forward with gradients meets it at the plugin's loss; an
        evaluation that reads the outputs itself has none, and the others returned outputs
        computed from the failed rank's stand-ins (the zeros its replay of the tp
        collectives sends) without a word. Raises RingPeerError naming the failed ranks,
        after taking the ring reports they left waiting, and after telling the other model
        replicas (:meth:`_tell_other_replicas`). One control collective."""
        try:
            get_ring(self.no_grad_group).agree(True, "", about="loss")
        except Exception as exc:
            self.take_ring_reports(exc, self.no_grad_group)
            self._tell_other_replicas(exc)
            raise

    def _tell_other_replicas(self, exc: BaseException) -> None:
        """A forward under no_grad that raised on this model replica (whose ranks raise at
        its end, ``forward_ended``) between a forward with gradients and its backward: where
        ``no_grad_group`` is one replica of several (zero 0 with data parallelism) the other
        replicas go on, and this rank meets them, as failed, where they go next: at the
        plugin's loss when it had not run (a reference model's forward), else at the
        backward (its agreement, then the data-parallel collectives on zeros and the status
        vector). Before, they waited there until the ring timeout. The model evaluated may be
        another than the one whose backward waits (a teacher's), also inside ``no_sync``.
        Not covered: several models waiting. Never raises (notes on ``exc``)."""
        if (not self.backward_pending or not dist.is_initialized()
                or self.no_grad_group is None
                or dist.get_world_size(self.no_grad_group) == dist.get_world_size()):
            return  # (one replica, or no backward waits: an evaluation alone)
        if not self.loss_ran:
            self._report_to_loss(exc, self.loss_group)
            return
        waiting = [r for r in self.reductions if r.expecting]
        if len(waiting) != 1:
            return
        reduction = waiting[0]
        if self.before_completion is not None:
            try:
                self.before_completion(reduction)
            except Exception as agree_exc:  # noqa: BLE001 - raised on every rank
                add_note(exc, f"ringseq: the agreement before the backward raised too: "
                              f"{type(agree_exc).__name__}: {agree_exc}")
                return
        note = reduction.after_failure(2 * ring_timeout(), exc)
        if note:
            self.unusable = note
            add_note(exc, note + ". The process group cannot be used again: restart the "
                                 "processes (booster.reset() refuses)")

    @torch.compiler.disable  # (host code on process groups: a compiled model's failure runs it)
    def _after_failure(self, phase: str, exc: BaseException, calls: int, reduction,
                       agreed_at_end: bool = False, loss=None) -> None:
        # The ring report waits for the peers' next ring call, and FSDP's collectives this
        # rank did not reach may come first on the peers (an all-gather before a layer's
        # attention, a reduce-scatter after it): the report runs in a thread meanwhile. For
        # a forward, the loss every rank reaches next hears of it last.
        report_errors = []
        # A forward under no_grad between a forward and its backward (an evaluation): the
        # other ranks go on to that backward, so this rank completes it too, and its ring
        # peers hear of the failure there if not before.
        # (Only once the plugin's loss ran: before it, the others wait at that loss; and not
        # where the forward ends with an agreement: the others meet the loss report there.)
        pending = (phase == "forward" and reduction is not None and reduction.expecting
                   and not torch.is_grad_enabled() and self.loss_ran and not agreed_at_end)

        to_ring = self._ring_report_due(phase, exc, calls, always=pending)

        def report():
            try:
                if to_ring:
                    self.ring.report_failure(exc)
            except Exception as report_exc:  # noqa: BLE001 - this rank's own error wins
                report_errors.append(report_exc)
        # (in this thread's context: the report carries the step's call tag)
        thread = threading.Thread(target=contextvars.copy_context().run, args=(report,),
                                  name="ringseq failure report", daemon=True)
        thread.start()
        to_loss = phase == "forward" and not pending
        # The ring report waits until the ring peers meet it: in a ring call still ahead of
        # them, or -- when they are past their last one (a failure after the forward's last
        # attention in the first step, whose count is not known yet) -- at the loss, when
        # that is on another group (dp x sp, tp): there the loss report goes first, saying
        # that a ring report waits, and the peers that meet it take the ring report
        # (SequenceParallelLoss). Sent after the ring report, as before, it came only once
        # that had waited out the ring timeout, and every rank waited as long.
        # (after a forward under no_grad the others meet it at its end, over no_grad_group)
        report_group = self.no_grad_group if agreed_at_end else self.loss_group
        loss_first = to_loss and to_ring and get_ring(report_group) is not self.ring
        try:
            note = None
            if phase == "forward" and reduction is not None:
                note = reduction.after_forward_failure(2 * ring_timeout())
                replay = pending
                if replay and not note and self.before_completion is not None:
                    try:  # (the others agree before their backward's first collective)
                        self.before_completion(reduction)
                    except Exception as agree_exc:  # noqa: BLE001 - raised on every rank
                        # (no rank runs the backward: nothing to complete)
                        add_note(exc, f"ringseq: the agreement before the backward raised "
                                      f"too: {type(agree_exc).__name__}: {agree_exc}")
                        replay = False
                if replay and not note:
                    note = reduction.after_failure(2 * ring_timeout(), exc)
            elif phase == "backward":
                # Only the one model a backward waits on; with several boosted models waiting
                # the ranks' next collectives cannot be told, and none is sent.
                waiting = [r for r in self.reductions if r.expecting or r.reached()]
                if waiting and getattr(loss, "grad_fn", None) is not None:
                    # a model whose forward waits but which this loss does not reach: no
                    # rank runs its collectives in this backward (the loss's graph is the
                    # same program on every rank), so none are completed (before, this
                    # rank waited in them for twice the ring timeout). (A loss without a
                    # graph here only, detached by mistake: the others' reaches the model.)
                    from .grad_agreement import graph_leaves
                    leaves, hidden = graph_leaves(loss)
                    waiting = [r for r in waiting if r.reached() or r.reached_by(leaves, hidden)]
                if len(waiting) == 1:
                    note = waiting[0].after_failure(2 * ring_timeout(), exc)
                elif len(waiting) > 1:
                    note = (f"ringseq: the data-parallel collectives of the backward were not "
                            f"completed for the other ranks: {len(waiting)} boosted models "
                            f"wait for a backward, and which one's the others wait in cannot "
                            f"be told")
            if loss_first:
                self._report_to_loss(exc, report_group, ring_report_waits=True)
        finally:
            interrupted = _join(thread)
        for report_exc in report_errors:
            add_note(exc, f"ringseq: reporting it to the ring peers failed too: "
                          f"{type(report_exc).__name__}: {report_exc}")
        if note:
            # the others wait in collectives this rank did not complete: its next ones would
            # pair with those (the plugin's reset refuses)
            self.unusable = note
            add_note(exc, note + ". The process group cannot be used again: restart the "
                                 "processes (booster.reset() refuses)")
        if to_loss and not loss_first:
            self._report_to_loss(exc, report_group)
        if agreed_at_end:
            self._tell_other_replicas(exc)
        if interrupted is not None:
            raise interrupted

    def report_refusal(self, exc: BaseException, agreed_at_end: bool) -> None:
        """A forward this rank refused before any collective (the ranks of its model
        replica alike, given the same batch): the other replicas, given other batches, meet
        it where they go next, as a failed forward's report (``_after_failure``): at the loss,
        or at the agreement that ends a forward under no_grad (``agreed_at_end``,
        :meth:`forward_ended`). Never raises (notes on ``exc``)."""
        if dist.is_initialized():
            self._report_to_loss(exc, self.no_grad_group if agreed_at_end else self.loss_group)

    def _report_to_loss(self, exc: BaseException, group, ring_report_waits: bool = False) -> None:
        report_own_failure(group, exc, ring_report_waits=ring_report_waits)

    def _ring_report_due(self, phase: str, exc: BaseException, calls: int,
                         always: bool = False) -> bool:
        """Whether the ring peers may still be inside a ring call this rank will not make
        (and the ring can carry a report). ``always``: the peers have ring calls ahead
        whatever this rank's count says."""
        full = None if always else self._calls.get(phase)
        if full is None and not always and phase == "backward" and "forward" in self._calls:
            # the first backward: as many ring calls as its forward made (twice that when
            # every layer is recomputed): the peers, past them, would never meet a report
            full = self._calls["forward"] * self.backward_calls_per_forward
        local = not isinstance(exc, (RingError, RingMismatchError))  # peers don't know
        return (local and (full is None or calls < full) and self.ring.world_size > 1
                and self.ring.broken is None and self.ring.checks_on)

    def take_ring_reports(self, error: BaseException, group=_LOSS_GROUP) -> None:
        """After this rank's loss raised ``error`` (RingPeerError, or its own): takes the
        failure reports that ring peers named there left waiting on this rank's attention
        ring (see ``_after_failure``); a failure of that is a note on ``error``. ``group``:
        where the loss agreement ran (default ``loss_group``; ``forward_ended``'s is
        ``no_grad_group``)."""
        group = self.loss_group if group is _LOSS_GROUP else group
        loss_ring = get_ring(group)
        if loss_ring is self.ring or self.ring.broken is not None:
            return
        members = set(getattr(self.ring.transport, "members", ()))
        waiting = [r for r, text in loss_ring.peer_messages.items()
                   if RING_REPORT_WAITS in text and global_rank(group, r) in members]
        if waiting:
            try:
                self.ring.take_failure_report(error)
            except Exception as take_exc:  # noqa: BLE001 - the loss's error is the one raised
                add_note(error, f"ringseq: taking the failure report its ring peer(s) left "
                                f"waiting failed too: {type(take_exc).__name__}: {take_exc}")
        loss_ring.peer_messages = {}  # (taken: a later error cannot take them again)


class OptimizerWrapper:
    """The boosted optimizer: ``backward(loss)`` (scaled for fp16), ``clip_grad_by_norm(max_norm)``
    (unscales first for fp16), ``step()`` (unscales, skips steps with inf/NaN gradients for
    fp16), ``zero_grad()``; other attributes
    (``param_groups``, ``state``, ...) are the wrapped optimizer's. ``unwrap()`` returns it:
    build learning-rate schedulers on the optimizer before boosting, as usual."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler=None, model=None,
                 step: StepTag = None, reduced: ReducedGrads = None):
        self.optim = optimizer
        self.scaler = scaler
        #: the user's (possibly sharded) model the parameters belong to: sharded checkpoints
        #: name optimizer state by parameter name
        self.model = model
        self._step = StepTag() if step is None else step
        #: the replicated reduction's count of reduced backward passes (ReducedGrads), or None
        self.reduced = reduced
        #: why the parameters are no longer consistent over the ranks (a step that raised on
        #: some of them), or None; cleared by loading a checkpoint into this optimizer
        self.failed_step = None
        #: fp16: the gradients clip_grad_by_norm unscaled, as weak references, or None (see
        #: _unscaled)
        self._unscaled_grads = None
        #: fp16: a loss scaled through the plugin's scaler reached this optimizer's
        #: parameters since its last step (any of the optimizers sharing it scaled it)
        self._scaled = False
        #: fp16: the gradient tensors the last scaled backward left (weakly): gradients that
        #: are other tensors (cleared through model.zero_grad(), then a plain backward) are
        #: not scaled ones, whatever ``_scaled`` says
        self._scaled_grads = ()
        #: fp16: the last step used the scaled gradients, and no loss was scaled since
        self._stepped_scaled = False
        if scaler is not None:
            users = getattr(scaler, "_ringseq_users", None)
            if users is None:
                users = scaler._ringseq_users = weakref.WeakSet()
            users.add(self)

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if self.scaler is not None:
            settle_scaler(self.scaler)  # (the update the last iteration's steps left due)
            if self._unscaled():
                # gradients a clip unscaled and no step used (a refused step, say): scaled
                # again, so that this backward's scaled ones add to their like and the step
                # unscales all of them once (before: the first part was divided twice)
                scale_(self._grads(), torch.tensor(float(self.scaler.get_scale())))
                self._forget_unscale()
            loss = self.scaler.scale(loss)
        with call_tag(self._step.value):  # the backward's ring calls belong to this step
            loss.backward(*args, **kwargs)
        if self.scaler is not None:  # (one loss over two models: scaled for both)
            for user in self.scaler._ringseq_users:
                user._scaled = user._scaled or any(
                    p.grad is not None for group in user.optim.param_groups
                    for p in group["params"])
                user._scaled_grads = [weakref.ref(t) for t in map(_local, user._grads())]
                user._stepped_scaled = user._stepped_scaled and not user._scaled

    def step(self, *args, **kwargs):
        """The wrapped optimizer's step (through the grad scaler for fp16). Raises ValueError
        (on every rank) for gradients summed twice (see ReducedGrads) and after a step that
        raised on some ranks until a checkpoint is loaded. A step that raises on some ranks
        (an out-of-memory error laying out the optimizer's state, say) raises on every rank:
        the others raise RingPeerError naming them (one vote of the ranks after every step,
        on the default group's control channel), since their parameters were updated and
        those of the failed ranks were not. A refusal on some ranks only (one rank skipped
        ``zero_grad``, or loaded a checkpoint alone) is agreed before any rank steps: those
        ranks raise their ValueError, the others RingPeerError naming them, and no parameter
        moves."""
        refusal = None
        if self.reduced is not None:
            try:
                self.reduced.check_once()  # ValueError: gradients summed twice
            except ValueError as exc:
                refusal = exc
        if refusal is None and self.reduced is not None and self.reduced.resummed:
            again = [n for n, p in self._named_params() if id(p) in self.reduced.resummed
                     and p.grad is not None]
            if again:
                refusal = ValueError(
                    f"OptimizerWrapper.step: the gradient(s) of {again[:4]}"
                    f"{' ...' if len(again) > 4 else ''} were kept outside this optimizer "
                    f"(its zero_grad leaves them) and summed over the ranks again by a later "
                    f"backward (n·g0 + g1: W times too large); not stepping. Set their .grad "
                    f"to None (or call model.zero_grad()) before the backward of a step")
        if refusal is None and self.failed_step is not None:
            refusal = ValueError(
                f"OptimizerWrapper.step: {self.failed_step}; not stepping. Load the last "
                f"checkpoint on every rank first (booster.load_model and "
                f"booster.load_optimizer)")
        grads = self._grads()
        scaled = self._holds_scaled(grads)
        if refusal is None and self.scaler is not None and grads and not scaled \
                and self._stepped_scaled:
            refusal = ValueError(
                "OptimizerWrapper.step: precision='fp16', and the last step already used "
                "these gradients (no loss was scaled through booster.backward since: the grad "
                "scaler takes one step per scaled backward); not stepping again. Clear the "
                "gradients (optimizer.zero_grad()) and run the next backward first")
        elif refusal is None and self.scaler is not None and grads and not scaled:
            refusal = ValueError(f"OptimizerWrapper.step: {self._not_scaled()}; not stepping")
        inf = False
        if refusal is None and self.scaler is not None and grads:
            try:  # (read, not unscaled: a step a peer refuses leaves the gradients as they are)
                inf = found_inf(self.scaler, self.optim) if self._unscaled() else bool(
                    torch.stack([~torch.isfinite(_local(g)).all() for g in grads]).any())
            except Exception as exc:
                refusal = exc
        rows = None
        if dist.is_initialized():
            # (without it the others would step and then wait in the vote after the step)
            rows = get_ring(None).agree(refusal is None, str(refusal), error=refusal,
                                        about="optimizer step refusal",
                                        fields=(("inf or NaN in the gradients", int(inf), ANY),))
        elif refusal is not None:
            raise refusal
        if self.model is not None:
            # A forward since the backward (an evaluation) left FSDP units gathered: the step
            # updates the shards, and the next forward would find the units gathered and
            # compute with the parameters of before the step (before: that step's loss and
            # gradients 10-44 % off at zero stages 2 and 3, without a word).
            reshard_gathered(self.model)
        try:
            if self.scaler is None or not grads:
                # (no gradient: nothing to unscale, and GradScaler would assert; a step of
                # nothing, as without fp16)
                out = self.optim.step(*args, **kwargs)
            else:
                self._unscale(grads)
                if rows and any(row[0] for row in rows) and not found_inf(self.scaler,
                                                                          self.optim):
                    # Every rank skips the step when one rank's gradients overflowed after
                    # their sum (agreed above; before: that rank alone skipped and backed off,
                    # and the replicas parted)
                    mark_inf(self.scaler, self.optim)
                out = self.scaler.step(self.optim, *args, **kwargs)
                update_due(self.scaler)  # (once per iteration: the plugin's optimizers share it)
                self._unscaled_grads, self._scaled = None, False
                self._stepped_scaled = True
        except BaseException as exc:  # (SystemExit too: the peers would wait in the vote)
            self._vote(exc)
            raise
        self._vote(None)
        if self.reduced is not None:
            self.reduced.after_step()
        return out

    def _vote(self, exc) -> None:
        # A step that raised on one rank only would leave its parameters (or its FSDP
        # shards) behind the others' without any error on them, and training would go on
        # from a model no single process ever computed.
        if not dist.is_initialized():
            return
        message = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        try:
            get_ring(None).agree(exc is None, message + f" ({_STEP_FAILED})", raise_own=False,
                                 about="optimizer step")
        except Exception as vote_exc:  # RingPeerError; a timeout or desync: unknown, as bad
            ranks = getattr(vote_exc, "ranks", None)
            self.failed_step = (f"the optimizer step raised on rank(s) {ranks}" if ranks else
                                f"the vote after the optimizer step failed ({vote_exc})")
            if exc is None:
                raise
            add_note(exc, f"ringseq: the vote after it failed too: "
                          f"{type(vote_exc).__name__}: {vote_exc}")
        if exc is not None:
            self.failed_step = self.failed_step or "the optimizer step raised on this rank"
            add_note(exc, f"ringseq: {_STEP_FAILED}")

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients of all parameter groups to a total ``norm_type`` norm of
        ``max_norm`` and returns the norm before clipping. Call it between ``backward`` and
        ``step``. Under fp16 the gradients are unscaled first (``step`` then does not unscale
        again), so ``max_norm`` is in the units of the true gradients; an inf/NaN norm there
        still makes ``step`` skip. The norm is over every gradient of the optimizer's
        parameter groups, sharded ones (FSDP, tensor parallelism) over all their shards: the
        same float on every rank, which clips alike (``ringseq.plugin.grad_norm``: each
        rank's share computed locally, then one all-reduce). Returns it as a scalar tensor of
        the gradients' promoted dtype, as torch's clip does (equal to it within float
        rounding: the shares are summed in another order).

        ``max_norm`` and ``norm_type`` are numbers or 0-d tensors (``norm_type`` also
        ``"inf"``), as torch's ``clip_grad_norm_`` takes them.

        Raises ValueError on every rank for a ``max_norm`` that is not a finite number >= 0 (a
        negative one reversed the gradients, NaN made every parameter NaN) or a
        ``norm_type`` that is not > 0 (inf included) on any rank, under fp16 for gradients no
        loss scaled through ``booster.backward`` since the last step or the optimizer's or the
        model's ``zero_grad``, or that replaced those it left (not changed in place), for
        gradients not summed over the ranks yet (inside gradient accumulation: backward passes inside
        ``booster.no_sync`` and none after them; their norm is not the step's), and
        :class:`ringseq.RingMismatchError` for ranks that pass other ``max_norm``,
        ``norm_type`` or ``error_if_nonfinite`` values (each would clip by its own factor);
        with ``ringseq.set_consistency_check(False)`` no agreement runs (a rank refusing alone
        then leaves the others in the norm's all-reduce, as every check that setting turns
        off).
        A rank that fails computing its share (out of memory, say) raises its error, and the
        others :class:`ringseq.RingPeerError` naming it, before any gradient is clipped (the
        ranks agree on the control channel before the all-reduce, which they would otherwise
        wait in). ``error_if_nonfinite``: RuntimeError on every rank for an inf / NaN norm;
        under fp16 (an overflow of the loss scale) the scaler backs off once for it at its next
        update, before the next backward (no step records it)."""
        grads, failure, fields = [], None, []
        for name, value, ok, want in (
                ("max_norm", max_norm, lambda x: 0.0 <= x < math.inf, "a finite number >= 0"),
                ("norm_type", norm_type, lambda x: x > 0.0, "a number > 0 (inf: max norm)")):
            # (what torch's clip_grad_norm_ takes too: a 0-d tensor, norm_type 'inf')
            number = (not isinstance(value, bool) and isinstance(value, numbers.Real)) or (
                torch.is_tensor(value) and value.dim() == 0 and not value.is_meta
                and not value.is_complex() and value.dtype != torch.bool) or (
                name == "norm_type" and isinstance(value, str) and value.lower() == "inf")
            try:  # (an int beyond float64's range is inf, which the rules refuse)
                x = float(value) if number else math.nan
            except OverflowError:
                x = math.inf
            # (compared over the ranks exactly: a rank clipping by another factor)
            fields.append(float_field(name, x, torch.float64))
            if failure is None and not (number and ok(x)):
                # (raised through the agreement below: the others raise with it, not wait)
                failure = ValueError(f"clip_grad_by_norm: {name} must be {want}, got {value!r}")
        fields.append(("error_if_nonfinite", int(bool(error_if_nonfinite)), "bool"))
        unsummed = None if self.reduced is None else self.reduced.unsummed()
        if failure is None and unsummed is not None:
            failure = ValueError(
                f"clip_grad_by_norm: {unsummed}, so the gradients are not summed over the "
                f"ranks yet and their norm is not the step's; clip after the backward of the "
                f"LAST micro-batch (its forward and backward outside no_sync), right before "
                f"step")
        try:
            if failure is not None:
                raise failure
            max_norm, norm_type = float(max_norm), float(norm_type)
            grads = self._grads()
            if self.scaler is not None and grads and not self._holds_scaled(grads):
                # (before: unscaled all the same, the norm and the gradients 65536 times too
                # small, as the step that followed)
                raise ValueError(f"clip_grad_by_norm: {self._not_scaled()}")
            # (no gradient: nothing to unscale, and GradScaler would assert, as in step)
            if self.scaler is not None and grads:
                self._unscale(grads)
            share = local_norm_share(grads, norm_type)
        except BaseException as exc:  # re-raised by the agreement (SystemExit too)
            failure = exc
        if dist.is_initialized():
            get_ring(None).agree(failure is None, f"{type(failure).__name__}: {failure}",
                                 error=failure, about="clip_grad_by_norm",
                                 fields=tuple(fields), called="OptimizerWrapper.clip_grad_by_norm",
                                 hint="every rank must pass the same max_norm, norm_type and "
                                      "error_if_nonfinite (each would clip by its own factor)")
        elif failure is not None:
            raise failure
        total = total_norm(share, norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            text = (f"clip_grad_by_norm: the total norm of order {norm_type} of the gradients "
                    f"is {total}, so they cannot be clipped")
            if self.scaler is not None:
                # An overflow of the loss scale (or a NaN loss), which no step records: the
                # update before the next loss backs off for it (before: the scale never came
                # down, and every iteration after raised the same)
                scale = float(self.scaler.get_scale())
                overflowed(self.scaler)
                raise RuntimeError(
                    f"{text}: with precision='fp16' the loss scale {scale:g} overflowed them "
                    f"(or the loss is not finite); the grad scaler lowers it to "
                    f"{scale * self.scaler.get_backoff_factor():g} for the next backward. Skip "
                    f"this step (optimizer.zero_grad()), or pass error_if_nonfinite=False: the "
                    f"step then skips itself")
            raise RuntimeError(f"{text} (pass error_if_nonfinite=False to clip anyway)")
        # As torch's clip: the norm in the gradients' promoted dtype, the factor
        # max_norm / (norm + 1e-6) at most 1 in it (a NaN norm makes every gradient NaN, so
        # that nothing steps on half-clipped gradients)
        dtype = (functools.reduce(torch.promote_types, [g.dtype for g in grads]) if grads
                 else torch.float32)
        first = grads[0].to_local() if grads and hasattr(grads[0], "to_local") else (
            grads[0] if grads else None)
        norm = torch.tensor(total, dtype=dtype, device=None if first is None else first.device)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if not math.isfinite(total) or total + 1e-6 > max_norm:  # (else a factor of 1)
            scale_(grads, factor)
        return norm

    def _unscale(self, grads) -> None:
        """fp16: unscales ``grads`` (the optimizer's gradients) unless they already are, and
        marks them so, at once: a clip refused after it by the ranks' agreement left them
        unscaled unmarked (before: a retry raised torch's "unscale_() has already been
        called", and a step after new gradients applied them 65536 times too large)."""
        if not self._unscaled():
            self.scaler.unscale_(self.optim)
            self._unscaled_grads = [weakref.ref(t) for t in map(_local, grads)]

    def _named_params(self) -> list:
        """(name, parameter) of the optimizer's parameters (a shape where the model is not
        known)."""
        names = {} if self.model is None else {
            id(p): n for n, p in self.model.named_parameters()}
        return [(names.get(id(p), f"tensor of shape {tuple(p.shape)}"), p)
                for group in self.optim.param_groups for p in group["params"]]

    def _grads(self) -> list:
        """The gradients of the optimizer's parameters (those that have one)."""
        return [p.grad for group in self.optim.param_groups for p in group["params"]
                if p.grad is not None]

    def _unscaled(self) -> bool:
        """fp16: whether the gradients now are the tensors clip_grad_by_norm unscaled (then
        neither another clip nor the step unscales them again; changed in place since, by
        torch's own clip say, they still are). Where they are other tensors -- a backward
        after ``model.zero_grad()`` or after loading a checkpoint, which clear no mark of the
        optimizer's -- the scaler's mark is forgotten (GradScaler clears it only in update(),
        after a step): new gradients are scaled ones, and were applied times the scale
        (65536) without being unscaled. (A backward through :meth:`backward` onto the
        unscaled tensors scales them again first.)"""
        seen = self._unscaled_grads
        if seen is None:
            return False
        now = [_local(g) for g in self._grads()]
        if len(now) == len(seen) and all(ref() is t for ref, t in zip(seen, now)):
            return True
        self._forget_unscale()
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        if self.reduced is not None:
            self.reduced.clear()
        self._forget_gradients()

    def _forget_gradients(self) -> None:
        """fp16: the gradients were cleared (this optimizer's or the model's zero_grad): no
        loss is scaled since, so a plain backward next is refused by step and clip (before,
        the flag of the cleared backward let a step apply 1/65536 of such gradients)."""
        self._forget_unscale()
        self._scaled = self._stepped_scaled = False
        self._scaled_grads = ()

    def _not_scaled(self) -> str:
        """Why the gradients are not the scaled ones the grad scaler can unscale (fp16)."""
        if self._scaled:
            return ("precision='fp16', and the gradients are not the tensors booster.backward "
                    "left (replaced since, as by p.grad = p.grad.clamp(...) after a clip, or "
                    "made by a plain backward), so the grad scaler cannot tell whether they "
                    "are scaled ones. Change gradients in place (p.grad.clamp_(...)), and run "
                    "every backward through booster.backward")
        return ("precision='fp16', but no loss was scaled through this optimizer since its "
                "last step or zero_grad (booster.backward(loss, optimizer) scales it), so the "
                "gradients are not scaled ones and the grad scaler cannot unscale them. Run "
                "the backward through booster.backward")

    def _holds_scaled(self, grads) -> bool:
        """fp16: whether ``grads`` (the optimizer's gradients now) are those a loss scaled
        through :meth:`backward` left: the flag, and the same tensors (before: gradients
        cleared through ``model.zero_grad()`` and made again by a plain backward passed, and
        a step applied 1/65536 of them)."""
        if not self._scaled:
            return False
        left = {id(t) for t in (ref() for ref in self._scaled_grads) if t is not None}
        return all(id(_local(g)) in left for g in grads)

    def add_param_group(self, param_group: dict) -> None:
        """The wrapped optimizer's ``add_param_group``, for parameters of the boosted model;
        collective (every rank adds the same group, as torch's optimizers need anyway).

        Raises ValueError on every rank (agreed on before any rank adds it) for a tensor
        that is not a parameter of the model as boost left it: a parameter taken before a
        sharded boost (zero stage 2/3, tensor parallelism replaced it; take it from
        ``model.unwrap()``), which would never move, or a tensor of no boosted model, whose
        gradient nothing sums over the ranks (the replicas would drift apart). Other
        refusals are torch's, raised on every rank alike. At zero stage 0 the step refuses
        an added parameter whose gradient, kept outside the optimizer (its ``zero_grad``
        leaves it), was summed over the ranks again by a later backward."""
        if not isinstance(param_group, dict) or self.model is None:
            return self.optim.add_param_group(param_group)  # (torch's TypeError, or unchecked)
        params = param_group.get("params")
        if torch.is_tensor(params):
            params = [params]
        elif not isinstance(params, set):  # (a set stays for torch to refuse, unordered)
            try:  # (any iterable, read once: a generator, dict values, a ParameterList)
                params = list(params)
            except TypeError:  # (not iterable: torch's own error)
                pass
        param_group = dict(param_group, params=params)
        refusal = None
        if isinstance(params, list):
            boosted = {id(p): n for n, p in self.model.named_parameters()}
            foreign = [tuple(p.shape) for p in params
                       if torch.is_tensor(p) and id(p) not in boosted]
            if foreign:
                refusal = ValueError(
                    f"OptimizerWrapper.add_param_group: the group holds tensor(s) of shape(s) "
                    f"{foreign[:4]}{' ...' if len(foreign) > 4 else ''} that are not "
                    f"parameters of the boosted model (a parameter taken before boost, which "
                    f"sharding replaced, would never move; a foreign tensor's gradient is "
                    f"summed over no ranks); take the parameters from model.unwrap()")
        if dist.is_initialized():
            get_ring(None).agree(refusal is None, str(refusal), error=refusal,
                                 about="optimizer param group",
                                 called="OptimizerWrapper.add_param_group")
        elif refusal is not None:
            raise refusal
        self.optim.add_param_group(param_group)

    def _forget_unscale(self) -> None:
        # GradScaler marks an optimizer "unscaled" in unscale_ (clip_grad_by_norm) and clears
        # the mark only in update(), after a step. A step refused or raised after a clip left
        # the mark: the next step then skipped unscaling and applied the gradients times the
        # scale (65536), and the next clip raised torch's "unscale_() has already been
        # called". New gradients are scaled ones: the mark goes with the old gradients.
        # (a stepped optimizer's inf checks stay for the update that is due)
        state = getattr(self.scaler, "_per_optimizer_states", {}).get(id(self.optim))
        if state is not None and state["stage"] is OptState.UNSCALED:
            del self.scaler._per_optimizer_states[id(self.optim)]
        self._unscaled_grads = None

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)
        self.failed_step = None  # (the model is loaded alongside)
        self._forget_unscale()

    def __getattr__(self, name):
        # not yet set (unpickling): no recursion
        if name in ("optim", "scaler", "model", "_step", "reduced", "failed_step",
                    "_unscaled_grads", "_scaled", "_scaled_grads", "_stepped_scaled"):
            raise AttributeError(name)
        try:
            return getattr(self.optim, name)
        except AttributeError:
            # (before: "'SGD' object has no attribute ...", naming the wrapped optimizer)
            hint = ("; it clips by norm only (clip_grad_by_norm), which under fp16 unscales "
                    "the gradients first" if name.startswith("clip_grad") else "")
            raise AttributeError(f"OptimizerWrapper (the boosted {type(self.optim).__name__}) "
                                 f"has no attribute {name!r}, nor has the optimizer it "
                                 f"wraps{hint}") from None

    def __repr__(self):
        return f"OptimizerWrapper({self.optim!r}, scaler={self.scaler is not None})"


class SequenceParallelLoss:
    """The plugin's criterion: token-mean next-token cross-entropy over the GLOBAL batch.

    ``criterion(outputs, batch)``:
        outputs: logits (b, s_local, vocab) of any float dtype, or a model output with
            ``.logits`` (transformers) or a ``"logits"`` key.
        batch: the sharded batch of the plugin's data loader (its ``shift_labels``, (b, s_local)
            int64), or the targets tensor itself.

    Returns a float32 scalar (float64 for float64 logits), identical on every rank:
    sum of token losses over all dp x sp (x tp) ranks / number of targets over all ranks (one
    all-reduce over ``group``; ``ignore_index`` targets excluded; 0 when there is none).
    Raises ValueError for mismatched shapes or a batch without ``shift_labels`` (on this
    rank; the other ranks of ``group`` raise RingPeerError naming it at their loss).

    With tensor parallelism (``tp_size > 1``) the model's logits cover this tp rank's share of
    the local sequence, (b, s_local / tp_size, vocab) (``ringseq.parallel.tp``), and the
    targets (b, s_local) are cut alike (contiguous share ``tp_rank``); logits of the whole
    s_local raise ValueError, since every tp rank would count the same tokens.

    ``sequence_parallel_aware = True`` marks a criterion the plugin may use unchanged; a
    custom criterion carrying it must likewise return the global token mean over all ranks
    (see RingSequenceParallelPlugin for why).
    """

    sequence_parallel_aware = True

    def __init__(self, group=None, ignore_index: int = -100, tp_size: int = 1, tp_rank: int = 0):
        size, rank = check_size_and_rank("SequenceParallelLoss", "tp_size", tp_size, "tp_rank",
                                         tp_rank)
        self.group = group
        self.ignore_index = ignore_index
        self.tp_size, self.tp_rank = size, rank
        #: the plugin's FailureReporter, told when the loss ran (or None)
        self.reporter = None

    def __call__(self, outputs, batch) -> torch.Tensor:
        try:
            logits, targets = self._logits_and_targets(outputs, batch)
        except BaseException as exc:  # (SystemExit too)
            # The other ranks are about to wait for this one in the loss's agreement.
            report_own_failure(self.group, exc)
            if self.reporter is not None:  # (a ring peer's forward may have raised too)
                self.reporter.take_ring_reports(exc)
            raise
        try:
            loss = sharded_cross_entropy(logits, targets, group=self.group,
                                         ignore_index=self.ignore_index)
        except BaseException as exc:  # a peer's forward raised (RingPeerError), or this loss
            if self.reporter is not None:
                self.reporter.take_ring_reports(exc)
            raise
        if self.reporter is not None:
            self.reporter.loss_ran = True  # every rank passed this step's loss
        return loss

    def _logits_and_targets(self, outputs, batch):
        logits = outputs
        if not torch.is_tensor(logits):
            logits = (outputs.get("logits") if isinstance(outputs, Mapping) else
                      getattr(outputs, "logits", None))
        if not torch.is_tensor(logits):
            raise ValueError(f"the criterion needs logits (b, s_local, vocab) or a model output "
                             f"with .logits, got {type(outputs).__name__}"
                             + (" without 'logits'" if isinstance(outputs, Mapping) else ""))
        targets = batch
        if not torch.is_tensor(targets):
            if not isinstance(batch, Mapping) or "shift_labels" not in batch:
                raise ValueError("the criterion needs the batch's 'shift_labels' (from the "
                                 "plugin's data loader, i.e. a batch that had 'labels') or the "
                                 "targets tensor (b, s_local), got "
                                 + (f"a batch with keys {sorted(map(str, batch))}"
                                    if isinstance(batch, Mapping) else given(batch)))
            targets = batch["shift_labels"]
        if self.tp_size > 1:
            targets = self._tp_share(logits, targets)
        return logits, targets

    def _tp_share(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, t = targets.shape[-1], self.tp_size
        # (b, s, vocab) and (b, s) only: flattened ones, (b * s / t, vocab) and (b * s,), pass
        # the length rule but pair each tp rank's logits, a share of every row, with a
        # contiguous cut of the flat targets (before: wrong targets, no error)
        if logits.dim() < 3 or targets.dim() != logits.dim() - 1 or \
                logits.shape[:-2] != targets.shape[:-1] or logits.shape[-2] * t != n:
            raise ValueError(
                f"with tp_size={t} the criterion needs logits of this tensor-parallel rank's "
                f"share of the sequence, (b, {n} / {t}, vocab), for targets (b, s_local) = "
                f"{tuple(targets.shape)}; got logits {tuple(logits.shape)}. Logits of the whole "
                f"local sequence on every tp rank would count each token {t} times: keep the "
                f"model's last norm and LM head sequence-parallel (ringseq.parallel.tp); "
                f"flattened logits and targets cannot be cut alike: pass them unflattened")
        return targets.narrow(-1, self.tp_rank * (n // t), n // t)

    def __repr__(self):
        tp = f", tp={self.tp_size}" if self.tp_size > 1 else ""
        size = None if self.group is None else dist.get_world_size(self.group)
        group = ("" if size is None else f", group of {size} ranks" if size > 0 else
                 ", a group without this rank")  # (-1: this rank is not a member)
        return f"SequenceParallelLoss(ignore_index={self.ignore_index}{tp}{group})"
