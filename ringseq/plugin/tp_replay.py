"""The tensor-parallel (tp > 1) training step, replicated (zero stage 0), when a forward or
backward raises on some ranks: what keeps the others from waiting in the tp group's
collectives.

In the plugin's tensor-parallel layout (``ringseq.parallel.tp``) every block (an attention or
MLP block) makes two blocking collectives on the tp group in the forward: the all-gather of
its input share (``GatherSequence``) and the reduce-scatter of its row-wise output; the
backward makes the same two per block in reverse order (the all-gather of the output's
gradient, then the reduce-scatter of the input's), and the gradient sync at its end
(``ReplicatedGradSync``) one all-reduce over tp per gradient that is a partial sum (those of
the replicated parameters but the row-wise biases), then one over the dp x sp ranks per
dtype. A rank whose forward or backward raised stops making them, and its tp peers would
wait in the next one until the process group's timeout; its ring peers raise
in their ring call and stop too, leaving their own tp peers waiting.

So every rank whose forward or backward raised makes the rest of them itself, on zeros
(:meth:`TpReplay.after_forward_failure`, :meth:`TpReplay.after_failure`). What was done is
read from the tp group's collective count (torch's per-group sequence number) since the
forward began or the backward reached the model's outputs; what remains is the list of the
phase's collectives from there, with this step's sizes: the batch and sequence from this
forward's input embedding, each block's hidden sizes and dtypes as its last forward saw them
(before any: the linear layers' sizes, the embedding's dtype for the gathered input and the
autocast dtype, else the weights', for the row-wise output). The forward's list is the blocks
in the last forward's order; the backward's is the order the last backward that ended made
them in (hooks next to each collective record it), which includes the forwards of
checkpointed layers recomputed within it; before any backward ended, the backward
collectives whose hooks the forward set, in reverse.
After every backward the ranks all-reduce a status vector (W int64, the default group) in
which a rank whose backward raised marks itself (then, where one did, the start of its
error); the others raise RingPeerError instead of stepping on invalid gradients.

Not completed (the rank's error gets a note and the plugin's reset refuses on it): the first
backward of a model with checkpointed layers (their recomputed forwards interleave with it in
an order of torch's checkpoint that no backward has shown yet), a backward of two forwards,
a failure before the input embedding saw this forward's batch, a process group that does not
count its collectives. Not set up: a plan of the user's own ParallelStyles (its collectives
are not known here). With FSDP (zero stage 2/3) there is no gradient sync (FSDP sums over
tp in its post-backward) and ``fsdp_replay.FsdpReplay`` makes these collectives among its
own, through :meth:`TpReplay.forward_ops`, :meth:`TpReplay.backward_ops` and the notes.
A parameter that requires a gradient and holds none is summed (as zeros) where
:meth:`TpReplay.reduces` says the others sum it: as the agreement before the backward found
(``grad_agreement``: any rank uses it), else as the last sync had it (without the agreement,
a parameter whose use changed in the failed step makes the completion's sums differ in size
from the others').
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..parallel.modules import grad_tensors
from ..parallel.tp import GatherSequence, SliceSequence
from .._dist import collective_count, ring_timeout
from .completion import Completion, agree_on_status, bounded, peers_failed_error

__all__ = ["TpReplay"]


class _Block:
    """One block of the plan (a ``GatherSequence`` module): its hidden sizes in (the gathered
    input) and out (the row-wise output), and the dtypes its last forward gathered and
    reduce-scattered (None before one did)."""

    def __init__(self, module: nn.Module, h_in: int, h_out: int, rowwise: nn.Module):
        self.module, self.h_in, self.h_out, self.rowwise = module, h_in, h_out, rowwise
        self.gather_dtype: Optional[torch.dtype] = None
        self.scatter_dtype: Optional[torch.dtype] = None


def _not_completed(what: str, why: str) -> str:
    """The note on a rank's own error when the tp collectives of ``what`` were not made."""
    return (f"ringseq: the tensor-parallel collectives of {what} were not completed for the "
            f"other ranks: {why}")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # (a checkpointed layer recomputed)


class TpReplay(Completion):
    """The tp group's collectives for a rank whose forward or backward raised, and the status
    check of the ranks whose backward ended, for one boosted model (see the module doc).

    ``model``: the user's model after tensor parallelism; ``plan``: the resolved plan it was
    built with (of plan names, not ParallelStyles); ``tp_mesh``: the 1-D tp mesh;
    ``grad_sync``: the model's ``ReplicatedGradSync`` (None under FSDP, whose replay drives
    this one); ``compute_dtype``: the plugin's autocast dtype, or FSDP's ``param_dtype``
    (None without either); ``params_cast``: ``compute_dtype`` is FSDP's, which every
    parameter is cast to in the forward (float64 ones too, which autocast leaves as they
    are); ``checkpointed()``: whether the backward will recompute layers."""

    def __init__(self, model: nn.Module, plan, tp_mesh, grad_sync, compute_dtype,
                 checkpointed: Callable[[], bool], params_cast: bool = False):
        self.mesh, self.group = tp_mesh, tp_mesh.get_group()
        self.grad_sync, self.compute_dtype = grad_sync, compute_dtype
        self.params_cast = params_cast and compute_dtype is not None
        self.checkpointed = checkpointed
        self.expecting = False
        modules = dict(model.named_modules())
        #: why the tp collectives of this model cannot be listed here, or None
        self.irregular: Optional[str] = None
        self.blocks: List[_Block] = []
        embedding = None
        for name, style in plan.styles.items():
            if isinstance(style, SliceSequence):
                embedding = modules[name]
            if not isinstance(style, GatherSequence):
                continue
            children = {n: plan.styles[n] for n in plan.styles if n.startswith(name + ".")}
            colwise = [modules[n] for n, s in children.items() if isinstance(s, ColwiseParallel)]
            rowwise = [modules[n] for n, s in children.items() if isinstance(s, RowwiseParallel)]
            if len(rowwise) != 1 and self.irregular is None:
                self.irregular = (f"the block {name!r} has {len(rowwise)} row-wise layers (one "
                                  f"reduce-scatter each, where one per block is known here)")
            self.blocks.append(_Block(modules[name], colwise[0].in_features,
                                      rowwise[0].out_features, rowwise[0]))
        self.embedding = embedding
        self.device = next(embedding.parameters()).device
        # (the gathered input's dtype before a forward showed it: the embedding's output)
        self._emb_dtype = compute_dtype if self.params_cast else next(embedding.parameters()).dtype
        self._order: List[_Block] = []        # the blocks in the last complete forward's order
        self._order_now: List[_Block] = []
        #: the block collectives of the last backward that ended, in order: (block, kind)
        self._backward_order: Optional[list] = None
        self._backward_order_checkpointed = False
        self._backward_now: list = []
        self._watching = False  # inside booster.backward (not torch.autograd.grad, say)
        self._share = None                    # this forward's (b, s_local / t)
        self._grad_share = None               # that of the last forward with gradients
        self._forward_base = self._backward_base = None  # the tp count then
        self._in_backward = False
        self._grad_forwards = 0               # forwards with gradients since the last backward
        self._hooked_now: list = []           # (block, kind) of the backward collectives of
        self._hooked: list = []               # this forward / the last one with gradients
        self._output_hooked = False
        for block in self.blocks:
            block.module.register_forward_pre_hook(
                lambda _m, args, kwargs, block=block: self._gathered(block, args, kwargs),
                with_kwargs=True)
            block.rowwise.register_forward_hook(
                lambda _m, _args, out, block=block: self._scattered(block, out))
        # (after SliceSequence's own hooks: the ids are this rank's share)
        embedding.register_forward_pre_hook(lambda _m, args: self._embedding_input(args))
        embedding.register_forward_hook(lambda _m, _args, out: self._embedding_output(out))
        model.register_forward_hook(lambda _m, _args, out: self._model_output(out))

    def collectives(self) -> Optional[int]:
        """The tp group's collective count (torch's per-group sequence number), or None where
        the process group does not count."""
        return collective_count(self.group)

    # -- what the forward does -------------------------------------------------------------
    # Each hook below runs right before or right after one tp collective, with no other in
    # between, so the backward's record lists its collectives in their order.
    def _gathered(self, block: _Block, args, kwargs) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_tensor(x):
            block.gather_dtype = x.dtype
        if _in_backward():  # a checkpointed layer's forward again: its all-gather
            self._backward_now.append((block, "gather"))
        else:
            self._order_now.append(block)
        # (recomputed too: a reentrant checkpoint runs the backward of the recomputed graph)
        if torch.is_tensor(x) and x.requires_grad:  # (before its backward's reduce-scatter)
            self._hook(x, block, "gather grad")

    def _scattered(self, block: _Block, out) -> None:
        if not torch.is_tensor(out):
            return
        block.scatter_dtype = out.dtype
        if _in_backward():  # (recomputed: its reduce-scatter)
            self._backward_now.append((block, "scatter"))
        if out.requires_grad:  # (before its backward's all-gather)
            self._hook(out, block, "scatter grad")

    def _hook(self, t: torch.Tensor, block: _Block, kind: str) -> None:
        if not _in_backward():
            self._hooked_now.append((block, kind))  # (a collective this forward's backward makes)

        def record(grad):
            self._backward_now.append((block, kind))
            return grad
        t.register_hook(record)

    def _embedding_input(self, args) -> None:
        if args and torch.is_tensor(args[0]) and not _in_backward():
            ids = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
            self._share = tuple(ids.shape[:2])  # (b, s_local / t)

    def _embedding_output(self, out) -> None:
        if torch.is_tensor(out):
            self._emb_dtype = out.dtype

    def _model_output(self, out) -> None:
        if _in_backward() or not torch.is_grad_enabled():
            return
        for t in grad_tensors(out):  # the backward reached this model (its tp collectives)
            t.register_hook(self._backward_began)
            self._output_hooked = True

    def _backward_began(self, grad):
        if self._watching and not self._in_backward:
            self._in_backward, self._backward_base = True, self.collectives()
            self._backward_now = []
        return grad

    def forward_started(self) -> None:
        self._forward_base, self._share, self._order_now = self.collectives(), None, []
        self._hooked_now, self._output_hooked = [], False

    def backward_started(self) -> None:
        self._watching = True

    def backward_ended(self) -> None:
        self._watching = False
        if not self.expecting:
            self._in_backward = False

    def reached(self) -> bool:
        return self._watching and self._in_backward and not self.expecting

    def forward_ran(self) -> None:
        """A forward whose output needs a gradient waits for its backward (one under no_grad,
        or of a frozen model, leaves the wait as it was)."""
        if len(self._order_now) == len(self.blocks) == len(set(map(id, self._order_now))):
            self._order = self._order_now
        elif self.irregular is None:
            self.irregular = (f"a forward ran {len(self._order_now)} blocks, not each of the "
                              f"{len(self.blocks)} once")
        if self._output_hooked:
            self.expecting, self._in_backward, self._backward_base = True, False, None
            self._grad_forwards += 1
            self._grad_share, self._hooked = self._share, self._hooked_now
            if self.grad_sync is not None:  # (its sync of this backward has not begun)
                self.grad_sync.sent = 0

    # -- the collectives, on zeros ---------------------------------------------------------
    def _dtypes(self, block: _Block):
        gather = block.gather_dtype or self._emb_dtype
        weight = block.rowwise.weight.dtype  # (autocast leaves float64 as it is)
        scatter = block.scatter_dtype or (
            self.compute_dtype if self.params_cast or (self.compute_dtype is not None
                                                       and weight != torch.float64) else weight)
        return gather, scatter

    def _redistribute(self, shape, dtype, src, dst) -> None:
        x = torch.zeros(shape, dtype=dtype, device=self.device)
        out = DTensor.from_local(x, self.mesh, [src], run_check=False).redistribute(
            self.mesh, [dst]).to_local()
        wait = getattr(out, "wait", None)  # (an asynchronous collective's result)
        if wait is not None:
            wait()

    def _gather(self, share, h: int, dtype) -> Callable[[], None]:
        b, s = share
        return lambda: self._redistribute((b, s, h), dtype, Shard(1), Replicate())

    def _scatter(self, share, h: int, dtype) -> Callable[[], None]:
        b, s = share
        t = self.mesh.size()
        return lambda: self._redistribute((b, s * t, h), dtype, Partial(), Shard(1))

    def forward_ops(self) -> List[Tuple[_Block, Callable[[], None]]]:
        """The forward's tp collectives, in order, each with its block."""
        ops = []
        for block in self._order or self.blocks:
            gather, scatter = self._dtypes(block)
            ops += [(block, self._gather(self._share, block.h_in, gather)),
                    (block, self._scatter(self._share, block.h_out, scatter))]
        return ops

    def forward_done(self) -> int:
        """The tp collectives this rank made since its forward began."""
        return self.collectives() - self._forward_base

    def backward_ops(self) -> List[Tuple[Optional[_Block], Callable[[], None]]]:
        """The backward's tp collectives, in order, each with its block (None: the gradient
        sync's sums over tp, last)."""
        order = self._backward_order
        if order is None or not self._order_holds():
            order = self._hooked[::-1]  # (without recomputed layers: after_failure checks)
        ops, share = [], self._grad_share  # (the forward this backward is of)
        for block, kind in order:
            gather, scatter = self._dtypes(block)
            if kind == "gather":  # (a recomputed forward's)
                op = self._gather(share, block.h_in, gather)
            elif kind == "scatter":
                op = self._scatter(share, block.h_out, scatter)
            elif kind == "scatter grad":  # (the output's gradient all-gathered)
                op = self._gather(share, block.h_out, scatter)
            else:  # "gather grad": the input's gradient reduce-scattered
                op = self._scatter(share, block.h_in, gather)
            ops.append((block, op))
        if self.grad_sync is not None and self.grad_sync.enabled:
            # the sync's sum over tp of each partial-sum gradient
            for p in self.grad_sync.params:
                if not (self.reduces(p) and self.partial_sum(p)):
                    continue
                local = p.to_local()
                ops.append((None, lambda local=local: self._redistribute(
                    local.shape, local.dtype, Partial(), Replicate())))
        return ops

    def reduces(self, param: nn.Parameter) -> bool:
        """The gradient sync sums ``param``'s gradient (a completion after a failure, zeros
        where it holds none): it requires one, and holds one (accumulated under no_sync) or
        did not go without one at the last sync (unused in the forward; before a sync ran,
        none is known)."""
        return param.requires_grad and (param.grad is not None
                                        or id(param) not in self.grad_sync.unused)

    def set_reduces(self, param: nn.Parameter, reduced: bool) -> None:
        """Makes the completion sum ``param``'s gradient, or leave it out (what the ranks
        agreed before the backward, ``grad_agreement``)."""
        unused = self.grad_sync.unused
        (unused.discard if reduced else unused.add)(id(param))

    def backward_done(self) -> int:
        """The tp collectives this rank made since its backward reached the model's outputs
        (0 before)."""
        return self.collectives() - self._backward_base if self._backward_base is not None else 0

    def partial_sum(self, param: nn.Parameter, owner: Optional[nn.Module] = None,
                    name: Optional[str] = None) -> bool:
        """``param``'s gradient comes out of the backward a partial sum over tp: it is
        replicated but not a row-wise layer's bias (in the plan's layout every other
        replicated parameter is used on a disjoint share per tp rank). ``owner`` and ``name``:
        the module and attribute name of ``param`` where it is not the module's parameter
        object itself (FSDP's unsharded parameter)."""
        if not (isinstance(param, DTensor)
                and all(pl.is_replicate() for pl in param.placements)):
            return False
        if owner is not None:
            return not (name == "bias" and any(owner is b.rowwise for b in self.blocks))
        return not any(param is block.rowwise.bias for block in self.blocks)

    def _order_holds(self) -> bool:
        """The last good backward's order fits this one: the same checkpointing and, where
        this forward set its hooks (not under a reentrant checkpoint's no_grad forward), the
        same gradient collectives (a layer frozen or unfrozen since changes them)."""
        if self._backward_order_checkpointed != bool(self.checkpointed()):
            return False
        if not self._hooked:
            return True

        def grads(entries):
            return Counter((id(b), k) for b, k in entries if k.endswith("grad"))
        return grads(self._backward_order) == grads(self._hooked)

    def _missing(self, what: str, share) -> Optional[str]:
        if self.irregular is not None:
            return _not_completed(what, self.irregular)
        if self.collectives() is None:
            return _not_completed(what, "this process group does not count its collectives")
        if share is None:
            return _not_completed(what, "this rank's forward raised before its input embedding "
                                        "saw the batch")
        return None

    def forward_note(self) -> Optional[str]:
        """Why the forward's tp collectives cannot be listed here, or None."""
        return self._missing("the forward", self._share)

    # -- Completion ------------------------------------------------------------------------
    def after_forward_failure(self, timeout: float) -> Optional[str]:
        """The rest of the forward's tp collectives (each block's all-gather and
        reduce-scatter), from the first this rank did not make."""
        note = self.forward_note()
        if note:
            return note
        done = self.forward_done()

        def replay():
            for _, op in self.forward_ops()[done:]:
                op()
        return bounded(replay, [self.group], timeout,
                       "the forward's tensor-parallel collectives")

    def second_backward_note(self) -> Optional[str]:
        """The note of a backward that failed though no forward waits for one: a second
        backward of one forward reached this model; else None (not this model's backward)."""
        if self.reached():  # (a second backward of a retained graph)
            return _not_completed("the backward", "a second backward of one forward")
        return None

    def backward_note(self) -> Optional[str]:
        """Ends the wait for the backward that raised; returns why its tp collectives cannot
        be listed here, or None."""
        self.expecting = False
        forwards, self._grad_forwards = self._grad_forwards, 0
        if forwards > 1:
            return _not_completed("the backward", f"it follows {forwards} forwards (each "
                                  f"block's collectives once per use), and they wait in them")
        if self.checkpointed() and (self._backward_order is None or not self._order_holds()):
            return _not_completed(
                "the backward", "it recomputes checkpointed layers, whose collectives "
                "interleave with it in an order of torch's checkpoint, and no backward has shown "
                "that order yet (the first step's, or the first since layers were frozen or "
                "checkpointing changed); they wait in them")
        return self._missing("the backward", self._grad_share)

    def after_failure(self, timeout: float, error: BaseException) -> Optional[str]:
        """The rest of the backward's tp collectives and of the gradient sync, on zeros, then
        this rank marked in the status vector (then the exchange of ``error``)."""
        if not self.expecting:
            return self.second_backward_note()
        note = self.backward_note()
        if note:
            return note
        done = self.backward_done()
        sync = self.grad_sync

        def replay():
            for _, op in self.backward_ops()[done:]:
                op()
            if sync.enabled and sync.group is not None and dist.get_world_size(sync.group) > 1:
                sizes = {}  # dtype -> elements, in the sync's order (it skips frozen ones)
                for p in sync.params:
                    if not self.reduces(p):
                        continue
                    local = p.to_local()
                    sizes[local.dtype] = sizes.get(local.dtype, 0) + local.numel()
                for dtype, n in list(sizes.items())[sync.sent:]:
                    flat = torch.zeros(n, dtype=dtype, device=self.device)  # (n,)
                    dist.all_reduce(flat, group=sync.group)
            self._status(error)
        groups = [self.group, sync.group, dist.group.WORLD]
        return bounded(replay, groups, timeout, "the backward's tensor-parallel collectives")

    def after_success(self) -> None:
        """Raises RingPeerError when another rank's backward did not end (its gradients are
        zeros in this rank's sums). One all-reduce of W int64 per backward
        (``completion.agree_on_status``; one more after a failure)."""
        if not self.ended():
            return  # (a backward of another model only)
        failed = self._status(None)
        if failed:
            raise peers_failed_error(failed)

    def ended(self) -> bool:
        """After a backward that ended on this rank: keeps the order it made its collectives
        in and ends the wait; False (nothing done) when it was not this model's backward."""
        if not (self.expecting and self._in_backward):
            return False
        self.expecting, self._in_backward, self._grad_forwards = False, False, 0
        # (a new list for the hooks of later backward passes, watched or not)
        self._backward_order, self._backward_now = self._backward_now, []
        self._backward_order_checkpointed = bool(self.checkpointed())
        return True

    def _status(self, error: Optional[BaseException]) -> Dict[int, str]:
        """The status all-reduce over the default group, this rank marked when ``error`` is
        given, then the errors' exchange where a rank is (``completion.agree_on_status``);
        returns the ranks marked, with the start of their errors."""
        return agree_on_status(None, range(dist.get_world_size()), dist.get_rank(),
                               self.device, error, ring_timeout())

    def reset(self) -> None:
        self.expecting, self._in_backward, self._grad_forwards = False, False, 0
        self._watching = False
