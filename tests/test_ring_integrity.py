"""No silent wrong results: failures, divergence and misuse of a ring end in a correct result or
a clear error on every rank, within seconds (ringseq.integrity).

One spawn per world size carries every case (spawning costs seconds). Each case returns what
happened on the rank -- an error type and message, or a result -- and the parent asserts.
Ranks run with a ring timeout of 20 s, so a hang shows up as RingTimeoutError, not as a stuck
test. Every case ends with the ring healthy again (reset_ring where it broke), which the next
case relies on; the cases run in a fixed order.
"""
from __future__ import annotations

import math
import os
import pickle
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ringseq
from ringseq.kernels import get_backend
from ringseq.kernels.base import AttentionBackend

from dist_utils import run_ranks
from utils import capture as _capture, max_err, node_copy

ENV = {"RINGSEQ_TIMEOUT": "20"}
FAST = 15.0  # seconds every error must arrive within (generous for a loaded 2-core CI box)


class InjectedFault(RuntimeError):
    """The exception a faulty backend raises (stands in for an out-of-memory error)."""


class FaultyBackend(AttentionBackend):
    """The reference kernel, raising InjectedFault on its ``fail_at``-th kernel call (counted
    over fwd, fwd_accum, bwd_accum) when ``armed``."""

    name = "faulty"

    def __init__(self):
        self.inner = get_backend("reference")
        self.count, self.fail_at, self.armed = 0, -1, False
        self.exc = InjectedFault  # what it raises

    def _tick(self):
        self.count += 1
        if self.armed and self.count == self.fail_at:
            raise self.exc(f"injected fault at kernel call {self.count}")

    def _fwd(self, q, k, v, scale, causal):
        self._tick()
        return self.inner._fwd(q, k, v, scale, causal)

    def _bwd(self, dout, q, k, v, out, lse, scale, causal, delta):
        self._tick()
        return self.inner._bwd(dout, q, k, v, out, lse, scale, causal, delta)


def _full(seed, s, h=4, h_kv=2, d=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, n, d, generator=g, dtype=dtype) for n in (h, h_kv, h_kv)]


def _fwd_bwd(q, k, v, layout="zigzag", backend=None, **kw):
    """This rank's (out, dq, dk, dv) of causal ring attention with dout = 1."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = ringseq.ring_flash_attn_func(qg, kg, vg, causal=True, layout=layout, backend=backend,
                                       **kw)
    dout = torch.ones_like(out)
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


def _reference_shards(full, layout):
    """This rank's shards of the float64 reference (out, dq, dk, dv) on the full sequence."""
    fq, fk, fv = (t.clone().requires_grad_() for t in full)
    out = ringseq.flash_attn_func(fq, fk, fv, causal=True, backend="reference")
    out.backward(torch.ones_like(out))
    return [ringseq.shard(t.detach(), layout) for t in (out, fq.grad, fk.grad, fv.grad)]


def _err(got, want):
    return max(max_err(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- cases (rank side)
def _case_fault_inside_call(fail_rank):
    """A rank raises inside a ring call; the training loop catches it and goes on."""
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(1, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    want = _reference_shards(full, "zigzag")
    be = FaultyBackend()
    be.fail_at, be.armed = 2, rank == fail_rank  # second kernel call of the forward
    res = {"fault": _capture(lambda: _fwd_bwd(*loc, backend=be))}
    be.armed = False
    # the ring is broken on every rank: later calls raise at once, with the cause
    res["later"] = _capture(lambda: _fwd_bwd(*loc, backend=be))
    res["later_again"] = _capture(lambda: _fwd_bwd(*loc))
    ringseq.reset_ring()
    res["after_reset_err"] = _err(_fwd_bwd(*loc), want)
    return res


def _case_interrupt_inside_call(fail_rank):
    """Ctrl-C (KeyboardInterrupt) on one rank inside a ring call, caught by the user's loop (a
    notebook): the call's exchanges still complete, so the other ranks raise at once."""
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(1, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    be = FaultyBackend()
    be.fail_at, be.armed, be.exc = 2, rank == fail_rank, KeyboardInterrupt
    t0 = time.monotonic()
    try:
        res = {"interrupt": ("ok", _fwd_bwd(*loc, backend=be))}
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is the case
        res = {"interrupt": (type(exc).__name__, str(exc), time.monotonic() - t0)}
    ringseq.reset_ring()
    res["after_reset_err"] = _err(_fwd_bwd(*loc), _reference_shards(full, "zigzag"))
    return res


def _case_skip_backward():
    """One rank skips its backward and goes on to the next forward."""
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(2, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    want = _reference_shards(full, "zigzag")
    q, k, v = (t.clone().requires_grad_() for t in loc)

    def step():
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")
        if rank != 1:
            out.sum().backward()
        return ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")

    res = {"skip": _capture(step)}
    ringseq.reset_ring()
    res["after_reset_err"] = _err(_fwd_bwd(*loc), want)
    return res


def _case_later_argument_change():
    """Default mode; one rank changes an argument on a later call only."""
    rank, w = dist.get_rank(), dist.get_world_size()
    out = {}
    base = dict(causal=True, layout="zigzag", softmax_scale=None)
    changes = {"seqlen": None, "dtype": None, "causal": dict(causal=False),
               "layout": dict(layout="stripe"), "scale": dict(softmax_scale=0.3),
               # (compared in micro-units before: 4e-7 met rank 0's 0, "off", and both ran)
               "softcap": dict(softcap=4e-7)}
    for name, change in changes.items():
        full = _full(3, 6 * w)
        kw = dict(base)
        lay = "zigzag"
        if rank == 1 and change:
            kw.update(change)
        loc = [ringseq.shard(t, kw["layout"]) for t in full]
        if rank == 1 and name == "seqlen":
            loc = [t[:, :-2] for t in loc]
        if rank == 1 and name == "dtype":
            loc = [t.float() for t in loc]
        ringseq.ring_flash_attn_func(*[ringseq.shard(t, lay) for t in full], **base)  # call 1
        out[name] = _capture(lambda: ringseq.ring_flash_attn_func(*loc, **kw))          # call 2
        # the ring stays usable after a mismatch: no payload moved
        good = [ringseq.shard(t, lay) for t in full]
        ref = ringseq.shard(ringseq.flash_attn_func(*full, causal=True, backend="reference"), lay)
        out[name + "_after"] = max_err(ringseq.ring_flash_attn_func(*good, **base), ref)
    # both ranks used both layouts before; then rank 1 switches
    full = _full(4, 6 * w)
    for lay in ("zigzag", "stripe", "zigzag", "stripe"):
        ringseq.ring_flash_attn_func(*[ringseq.shard(t, lay) for t in full], causal=True,
                                     layout=lay)
    lay = "stripe" if rank == 1 else "zigzag"
    out["switch"] = _capture(lambda: ringseq.ring_flash_attn_func(
        *[ringseq.shard(t, lay) for t in full], causal=True, layout=lay))
    # other document boundaries on rank 1: the message shows them (before: their hashes)
    packed = [ringseq.shard(t[0], "zigzag", dim=0) for t in _full(6, 6 * w)]
    cu = [0, 4 + (rank == 1), 6 * w]
    out["documents"] = _capture(lambda: ringseq.ring_flash_attn_varlen_func(
        *packed, cu, causal=True, layout="zigzag"))
    out["documents_after"] = _capture(lambda: ringseq.ring_flash_attn_varlen_func(
        *packed, [0, 4, 6 * w], causal=True, layout="zigzag"))
    # one scale written two ways: apart in float64, one float32, which the kernels use on
    # float32 inputs (d = 8: 8 ** -0.5 and 1 / math.sqrt(8) differ in their last float64 bit)
    f32 = [ringseq.shard(t.float()[..., :8], "zigzag") for t in _full(7, 6 * w)]
    out["scale_float32_alike"] = _capture(lambda: float(ringseq.ring_flash_attn_func(
        *f32, causal=True, softmax_scale=1 / math.sqrt(8) if rank == 1 else None).sum()))
    return out


def _case_double_backward():
    w = dist.get_world_size()
    full = _full(5, 6 * w)
    q, k, v = (ringseq.shard(t, "zigzag").requires_grad_() for t in full)

    def penalty():
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")
        (gk,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
        (out.sum() + gk.square().sum()).backward()

    return {"create_graph": _capture(penalty)}


def _case_threads():
    """Another thread of a rank calls ring attention on a group this rank's main thread uses:
    it raises at once (a ring is bound to the first thread that calls it, whatever the
    timing); the main thread's calls stay exact."""
    w = dist.get_world_size()
    full = _full(6, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    result = {}

    def other():
        result["other"] = _capture(lambda: ringseq.ring_flash_attn_func(
            *loc, causal=True, layout="zigzag"))

    t = threading.Thread(target=other)
    t.start()
    t.join(60)
    ref = ringseq.shard(ringseq.flash_attn_func(*full, causal=True, backend="reference"), "zigzag")
    main = ringseq.ring_flash_attn_func(*loc, causal=True, layout="zigzag")
    result["main_err"] = max_err(main, ref)
    # threads of other names on the ranks of a fresh group: their names are shown (before:
    # hashes of them)
    group = dist.new_group(list(range(w)))

    def named():
        result["named"] = _capture(lambda: ringseq.ring_flash_attn_func(
            *loc, causal=True, layout="zigzag", group=group))
    t = threading.Thread(target=named, name=f"loader of rank {dist.get_rank()}")
    t.start()
    t.join(60)
    return result


def _case_failure_before_the_call():
    """Work the ring does before its call opens (the plan; the zero upstream gradient of a
    backward) fails on rank 1 alone, as an out-of-memory error would: every rank raises at once
    and the ring stays usable without a reset."""
    from ringseq.engine import placement
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(7, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    want = _reference_shards(full, "zigzag")

    def failing_on_rank_1(real):
        def fn(*args, **kwargs):
            if rank == 1:
                raise InjectedFault("injected fault before the call")
            return real(*args, **kwargs)
        return fn

    res = {}
    for stage, name in (("forward", "make_plan"), ("backward", "ring_dout")):
        real = getattr(placement, name)
        setattr(placement, name, failing_on_rank_1(real))
        try:
            res[stage] = _capture(lambda: _fwd_bwd(*loc))
        finally:
            setattr(placement, name, real)
    # Ctrl-C there (before: not reported, the peer waited for the ring timeout)
    real = placement.make_plan

    def interrupted(*args, **kwargs):
        if rank == 1:
            raise KeyboardInterrupt("injected Ctrl-C before the call")
        return real(*args, **kwargs)
    placement.make_plan = interrupted
    t0 = time.monotonic()
    try:
        res["ctrl_c"] = _capture(lambda: _fwd_bwd(*loc))
    except KeyboardInterrupt as exc:
        res["ctrl_c"] = ("KeyboardInterrupt", str(exc), time.monotonic() - t0)
    finally:
        placement.make_plan = real
    res["after_err"] = _err(_fwd_bwd(*loc), want)
    return res


def _case_backward_tag():
    """A backward carries the tag its forward ran under, not the one current where it runs
    (an autograd worker thread, a later step's block): here each rank runs it under another
    tag, and the gradients are exact."""
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(8, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    want = _reference_shards(full, "zigzag")
    q, k, v = (t.clone().requires_grad_() for t in loc)
    with ringseq.call_tag(5):
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")

    def backward():
        with ringseq.call_tag(100 + rank):
            out.backward(torch.ones_like(out))
        return _err((out.detach(), q.grad, k.grad, v.grad), want)

    return {"backward": _capture(backward)}


_LAYOUT_OF = {"ring": "zigzag", "ulysses": "contiguous"}  # (Ulysses takes sequence shards)


def _attend(attn, q, k, v):
    """Causal attention of the local shards through ``attn``: "ring" or "ulysses"."""
    if attn == "ring":
        return ringseq.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")
    return ringseq.ulysses_attn_func(q, k, v, causal=True)


def _case_tags_with_checks_off(attn):
    """With the checks off, ranks at alike calls under other tags (a step apart) raise
    RingDesyncError naming both tags, and the ring works again after reset_ring (before: the
    exchange headers carried no tag and the ranks paired silently; Ulysses' all-to-alls
    carried no header until the forty-fourth session)."""
    rank, w = dist.get_rank(), dist.get_world_size()
    full = _full(8, 6 * w)
    loc = [ringseq.shard(t, _LAYOUT_OF[attn]) for t in full]
    want = _reference_shards(full, _LAYOUT_OF[attn])[0]

    def call():
        return _attend(attn, *loc)
    ringseq.set_consistency_check(False)
    try:
        with ringseq.call_tag(1 + rank):
            res = {"call": _capture(call)}
        ringseq.reset_ring()
        with ringseq.call_tag(7):
            res["after"] = _capture(lambda: float((call() - want).abs().max()))
    finally:
        ringseq.set_consistency_check(True)
    return res


def _case_backward_order(attn):
    """Two alike calls (same shapes, same tag) whose backwards the ranks run in another
    order: every rank raises RingMismatchError naming the forwards, and the next call is exact
    (before: the backwards paired, A's with B's, and every gradient was wrong, no error; in
    Ulysses until the forty-fourth session, A's dout moved to B's head shards)."""
    rank, w = dist.get_rank(), dist.get_world_size()
    layout = _LAYOUT_OF[attn]
    calls = {}
    with ringseq.call_tag(3):
        for name, seed in (("A", 21), ("B", 22)):
            loc = [ringseq.shard(t, layout).requires_grad_() for t in _full(seed, 6 * w)]
            calls[name] = _attend(attn, *loc)
    res = {}
    for name in ("AB" if rank == 0 else "BA"):
        res[name] = _capture(lambda: calls[name].sum().backward())
    full = _full(23, 6 * w)
    loc = [ringseq.shard(t, layout) for t in full]
    want = _reference_shards(full, layout)[0]
    res["after"] = _capture(lambda: float((_attend(attn, *loc) - want).abs().max()))
    return res


def _case_empty_batch():
    """A batch of zero rows (its gradient arrives expanded, with stride 0) runs forward and
    backward like flash_attn_func, twice: the ring is not left broken."""
    q = torch.randn(0, 8, 4, 16, dtype=torch.float64, requires_grad=True)
    res = []
    for _ in range(2):
        def step():
            ringseq.ring_flash_attn_func(q, q, q, causal=True).sum().backward()
            return tuple(q.grad.shape)
        res.append(_capture(step))
    return res


def _case_check_consistent():
    """ringseq.comm.check_consistent with fields that differ in count or name, or are
    malformed on one rank: every rank raises at once (before: a rank passing fewer fields
    returned; a malformed one raised alone and its peer waited for the ring timeout)."""
    from ringseq._hash import ints_field
    from ringseq.comm import check_consistent
    rank = dist.get_rank()
    same = [("seqlen", 128), ("nheads", 8)]
    return {"same": _capture(lambda: check_consistent(same)),
            "values": _capture(lambda: check_consistent([("seqlen", 128 + rank)])),
            "count": _capture(lambda: check_consistent(same[:1 + rank])),
            "names": _capture(lambda: check_consistent([("seqlen" if rank else "s", 128)])),
            "flag": _capture(lambda: check_consistent([("causal", True)])),  # (0 / 1)
            "kinds": _capture(lambda: check_consistent([("x", 1, "any" if rank else "int")])),
            "bad_kind": _capture(lambda: check_consistent([("x", 1, "ints")])),
            "kind_left_out": _capture(lambda: check_consistent([("x", 1, "int")] if rank
                                                               else [("x", 1)])),
            "bad_ints": _capture(lambda: check_consistent(
                [("docs", 5, "ints", (0, 5, 2 ** 64) if rank else (0, 5, 9))])),
            "flag_differs": _capture(lambda: check_consistent([("causal", rank == 0)])),
            "malformed": _capture(lambda: check_consistent(
                [("seqlen", "one" if rank else 1)])),
            "too_many": _capture(lambda: check_consistent([("f", 0)] * (24 + rank))),
            "ints": _capture(lambda: check_consistent([ints_field("docs", (0, 5 + rank, 9))])),
            # a layout field's text is shown per rank; texts that do not tell the ranks apart
            # are shown with their codes; a text on one rank only is named
            "texts": _capture(lambda: check_consistent([("lay", rank, "layout", f"L{rank}")])),
            "same_texts": _capture(lambda: check_consistent([("lay", rank, "layout", "L")])),
            "text_on_one": _capture(lambda: check_consistent(
                [("lay", 0, "layout", "L") if rank else ("lay", 0, "layout")])),
            "bad_text": _capture(lambda: check_consistent([("lay", 0, "layout", 7)])),
            "after": _capture(lambda: check_consistent(same)), **_checks_off_refusal()}


def _checks_off_refusal():
    """With the checks off a malformed check raises on its rank alone, and the ranks' next
    call still pairs (before: the refusing rank's control count fell behind, and the next
    ring call raised RingDesyncError on every rank)."""
    from ringseq.comm import check_consistent
    rank = dist.get_rank()
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)  # (b, s_local, h, d)
    ringseq.set_consistency_check(False)
    try:
        return {"off_malformed": _capture(lambda: check_consistent(
                    [("a",)] if rank else [("a", 1)])),
                "off_next_call": _capture(lambda: tuple(ringseq.ring_flash_attn_func(
                    q, q, q, causal=True).shape))}
    finally:
        ringseq.set_consistency_check(True)


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, dtype=torch.float64)

    def forward(self, q, k, v):
        out = ringseq.ring_flash_attn_func(self.proj(q), k, v, causal=True, layout="zigzag")
        return out.square().sum()


def _case_compile():
    """torch.compile(fullgraph=True) of a module calling ring attention."""
    torch._dynamo.reset()
    w = dist.get_world_size()
    full = _full(7, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    torch.manual_seed(0)
    mod = _Attn()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    got = {}
    for name, m in (("eager", mod), ("compiled", compiled)):
        mod.zero_grad()
        q, k, v = (t.clone().requires_grad_() for t in loc)
        loss = m(q, k, v)
        loss.backward()
        got[name] = [loss.detach(), q.grad, k.grad, v.grad, mod.proj.weight.grad.clone()]
    return {"diff": max(max_err(a, b) for a, b in zip(got["eager"], got["compiled"]))}


class _Exploit:
    def __reduce__(self):
        return (open, (os.environ["RINGSEQ_TEST_MARKER"], "w"))


def _case_checkpoints(tmp):
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank = dist.get_rank()
    booster = Booster(plugin=RingSequenceParallelPlugin(sp_size=dist.get_world_size()))
    out = {}
    # a crafted lr-scheduler checkpoint must not run code on any rank
    sched_path = os.path.join(tmp, "sched.pt")
    if rank == 0:
        with open(sched_path, "wb") as f:
            pickle.dump({"x": _Exploit()}, f)
    dist.barrier()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    out["sched"] = _capture(lambda: booster.load_lr_scheduler(sched, sched_path))
    out["marker"] = os.path.exists(os.environ["RINGSEQ_TEST_MARKER"])
    # a checkpoint one rank cannot read: every rank raises, naming path and rank
    model = torch.nn.Linear(3, 3)
    good = os.path.join(tmp, "good.pt")
    torch.save(model.state_dict(), good)
    # (one path for every rank, which rank 1's node holds as garbage: its reads go there)
    bad, garbage = os.path.join(tmp, "node_copy.pt"), os.path.join(tmp, f"garbage{rank}.pt")
    with open(garbage, "wb") as f:
        f.write(b"\x00not a checkpoint")
    if rank == 0:
        torch.save(model.state_dict(), bad)
    dist.barrier()
    before = [p.detach().clone() for p in model.parameters()]
    with node_copy(bad, garbage, active=rank == 1):
        out["load"] = _capture(lambda: booster.load_model(model, bad))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a symlink planted at <path>.tmp is never written through
    target = os.path.join(tmp, "victim.txt")
    if rank == 0:
        with open(target, "w") as f:
            f.write("precious")
        os.symlink(target, os.path.join(tmp, "model.pt.tmp"))
    dist.barrier()
    booster.save_model(model, os.path.join(tmp, "model.pt"))
    out["victim"] = open(target).read()
    out["saved_ok"] = torch.load(os.path.join(tmp, "model.pt"), weights_only=True).keys() == \
        model.state_dict().keys()
    return out


def _case_many_groups():
    """30 process groups created, used and destroyed: their rings are not kept alive."""
    import gc

    from ringseq.engine import ring as comm
    full = _full(8, 12)
    before = len(comm._RINGS)
    for _ in range(30):
        g = dist.new_group(list(range(dist.get_world_size())))
        loc = [ringseq.shard(t, "contiguous", g) for t in full]
        ringseq.ring_flash_attn_func(*loc, group=g)
        dist.destroy_process_group(g)
        del g, loc
    gc.collect()
    return {"kept": len(comm._RINGS) - before}


def _case_many_double_rings(rounds=3):
    """Double rings (two inner rings of 2 on 4 ranks) created, used (forward and backward)
    and destroyed, one after another: none of their rings -- the whole ring's, the inner's,
    the outer's -- is kept alive, as for a plain ring's group. Each round's double ring is
    exact: a later double ring of the same sizes plans like the first on rings of its own."""
    import gc
    import weakref

    from ringseq.engine.ring import get_ring
    full = _full(21, 8 * dist.get_world_size())
    want = _reference_shards(full, "zigzag")
    rings, errs = [], []
    for _ in range(rounds):
        sp = ringseq.make_sp_groups(1, 2)
        assert sp.double_ring
        loc = [sp.shard(t, "zigzag").requires_grad_() for t in full]
        out = ringseq.usp_attn_func(*loc, causal=True, sp=sp, layout="zigzag")
        out.backward(torch.ones_like(out))
        errs.append(_err([out.detach()] + [t.grad for t in loc], want))
        groups = sp.process_groups()  # the whole ring, the inner ring, the outer ring
        rings += [weakref.ref(get_ring(g)) for g in groups]
        for g in groups:
            dist.destroy_process_group(g)
        del sp, g, groups, loc, out
    gc.collect()
    return {"rings": len(rings), "kept": sum(ref() is not None for ref in rings),
            "max_err": max(errs)}


def _case_stalled_peer():
    """A peer stops calling ring attention: the waiting rank gets a ringseq timeout error."""
    import time
    rank = dist.get_rank()
    ringseq.set_ring_timeout(3)
    g = dist.new_group(list(range(dist.get_world_size())))
    full = _full(9, 12)
    loc = [ringseq.shard(t, "contiguous", g) for t in full]
    res = {}
    if rank == 0:
        res["stalled"] = _capture(lambda: ringseq.ring_flash_attn_func(*loc, group=g))
    else:
        time.sleep(5)
    # only rank 0 back-propagates through unshard (before: its backward's all_reduce paired
    # with the next collective of rank 1, both silently wrong, or waited for torch's timeout)
    g2 = dist.new_group(list(range(dist.get_world_size())))
    full = ringseq.unshard(torch.zeros(1, 4, 2, requires_grad=True), "zigzag", g2)
    if rank == 0:
        res["unshard_backward"] = _capture(lambda: full.sum().backward())
    else:
        time.sleep(5)
    ringseq.set_ring_timeout(None)
    dist.barrier()
    return res


def _booster_case():
    """A Booster step raises inside the model on one rank (a bad token id); the loop catches
    it: every rank raises within seconds, the next steps raise until reset, then training
    goes on exactly."""
    import transformers

    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank, w = dist.get_rank(), dist.get_world_size()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(0)
    booster = Booster(plugin=RingSequenceParallelPlugin(sp_size=w, layout="zigzag"))
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, criterion, *_ = booster.boost(model, opt)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, 8 * w), generator=g)
    good = ringseq.shard_batch({"input_ids": ids, "labels": ids})
    bad = dict(good)
    if rank == 1:
        bad["input_ids"] = good["input_ids"].clone()
        bad["input_ids"][0, 0] = 10_000  # out of the vocabulary: IndexError in the embedding

    def step(batch):
        loss = criterion(model(**batch), batch)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    out = {"good": _capture(lambda: step(good))}
    out["bad"] = _capture(lambda: step(bad))
    out["next"] = _capture(lambda: step(good))
    booster.reset()
    out["after_reset"] = _capture(lambda: step(good))
    return out


class _EveryRankFirst(ringseq.layouts.Layout):
    """Not a permutation: every rank claims the first s / W positions."""
    name = "every_rank_first"

    def _positions(self, seqlen, world_size, rank):
        return torch.arange(seqlen // world_size)


def _case_unshard_mismatch():
    """ringseq.unshard with shards that differ between ranks, or a length the layout cannot
    have on one rank: every rank raises (no all-gather of mismatched shards, no wait)."""
    rank = dist.get_rank()
    x = torch.arange(12.0).reshape(1, 6, 2) + 100 * rank
    res = {"shape": _capture(lambda: ringseq.unshard(x if rank == 0 else x[:, :4], "contiguous")),
           "dtype": _capture(lambda: ringseq.unshard(x if rank == 0 else x.double(), "contiguous")),
           "layout": _capture(lambda: ringseq.unshard(x, "zigzag" if rank == 0 else "stripe")),
           # dtypes outside the common ones (before: one shared index, bytes reinterpreted)
           "int8_uint8": _capture(lambda: ringseq.unshard(
               x.to(torch.int8 if rank == 0 else torch.uint8), "contiguous")),
           "odd_zigzag": _capture(lambda: ringseq.unshard(x if rank == 0 else x[:, :3], "zigzag")),
           # arguments rank 1 alone refuses (before: it raised at once, rank 0 waited in the
           # all-gather until the timeout)
           "typo": _capture(lambda: ringseq.unshard(x, "zigzag" if rank == 0 else "zigzg")),
           "bad_dim": _capture(lambda: ringseq.unshard(x, "zigzag", dim=1 if rank == 0 else 3)),
           # a layout of the user's whose ranks list position 0 twice: refused before the
           # all-gather, named (before: raised inside the gather, naming no function)
           "duplicates": _capture(lambda: ringseq.unshard(x, _EveryRankFirst()))}
    # two unshard calls of one shape, back-propagated in another order on each rank (before:
    # each rank's gradient summed with the other call's, silently)
    a, b = (torch.ones(1, 6, 2, requires_grad=True) for _ in range(2))
    full_a, full_b = ringseq.unshard(a, "zigzag"), ringseq.unshard(2 * b, "zigzag")
    res["backward_order"] = _capture(lambda: (full_a if rank == 0 else full_b).sum().backward())
    res["after"] = ringseq.unshard(x, "zigzag")  # the ring is usable afterwards
    return res


def _worker_w2(tmp):
    rank = dist.get_rank()
    os.environ["RINGSEQ_TEST_MARKER"] = os.path.join(tmp, f"pwned{rank}")
    res = {"unshard": _case_unshard_mismatch(),
           "interrupt": _case_interrupt_inside_call(fail_rank=1),
           "fault": _case_fault_inside_call(fail_rank=1),
           "skip_backward": _case_skip_backward(),
           "later_change": _case_later_argument_change(),
           "double_backward": _case_double_backward(),
           "threads": _case_threads(),
           "before_call": _case_failure_before_the_call(),
           "backward_tag": _case_backward_tag(),
           "tags_checks_off": _case_tags_with_checks_off("ring"),
           "tags_checks_off_ulysses": _case_tags_with_checks_off("ulysses"),
           "backward_order": _case_backward_order("ring"),
           "backward_order_ulysses": _case_backward_order("ulysses"),
           "empty_batch": _case_empty_batch(),
           "check_consistent": _case_check_consistent(),
           "compile": _case_compile(),
           "checkpoints": _case_checkpoints(tmp),
           "many_groups": _case_many_groups(),
           "stalled": _case_stalled_peer(),
           "booster": _booster_case()}
    dist.barrier()  # every rank is alive and in step after everything above
    return res


def _case_nan(layout):
    """A NaN in k (or v, or an inf in q) on one rank reaches every row that attends to it."""
    w = dist.get_world_size()
    s = 8 * w
    res = {}
    for what in ("k_nan", "v_nan", "q_inf"):
        full = _full(10, s, dtype=torch.float32)
        which, value = {"k_nan": (1, float("nan")), "v_nan": (2, float("nan")),
                        "q_inf": (0, float("inf"))}[what]
        full[which][0, 5 * s // 8, 0, 3] = value  # global position 5s/8, kv head / head 0
        loc = [ringseq.shard(t, layout) for t in full]
        res[what] = ringseq.ring_flash_attn_func(*loc, causal=True, layout=layout).detach()
    return res


def _case_fuzz(trials=50):
    """Random faults: at a random kernel call of a random ring call on a random rank. No
    result may be silently wrong: each call is either correct or raises."""
    import random
    rank, w = dist.get_rank(), dist.get_world_size()
    rng = random.Random(1234)  # the same draws on every rank
    full = _full(11, 6 * w)
    loc = [ringseq.shard(t, "zigzag") for t in full]
    want = _reference_shards(full, "zigzag")
    be = FaultyBackend()
    counts = {"correct": 0, "error": 0, "wrong": 0, "faults": 0}
    for _ in range(trials):
        victim = rng.randrange(w)
        call = rng.randrange(3)
        kernel_calls_per_pass = 2 * w  # forward tasks + backward tasks, at most
        fail_at = rng.randrange(1, kernel_calls_per_pass + 1)
        for c in range(3):
            be.count = 0
            be.fail_at = fail_at
            be.armed = rank == victim and c == call
            outcome = _capture(lambda: _fwd_bwd(*loc, backend=be))
            if be.armed and be.count >= fail_at:
                counts["faults"] += 1
            if outcome[0] == "ok":
                counts["correct" if _err(outcome[1], want) < 1e-9 else "wrong"] += 1
            else:
                counts["error"] += 1
        ringseq.reset_ring()
    return counts


def _worker_w4():
    rank = dist.get_rank()
    res = {"fault": _case_fault_inside_call(fail_rank=2), "skip_backward": _case_skip_backward(),
           "nan": {lay: _case_nan(lay) for lay in ("contiguous", "zigzag", "stripe")},
           "fuzz": _case_fuzz(), "many_double_rings": _case_many_double_rings()}
    # a rank outside a group calls shard / positions / unshard
    g = dist.new_group([0, 1])
    if rank >= 2:
        q = torch.randn(1, 8, 2, 16)  # (b, s_local, h, d)
        labels = torch.zeros(1, 4, dtype=torch.long)
        res["non_member"] = {
            "shard": _capture(lambda: ringseq.shard(torch.zeros(1, 8), "zigzag", g)),
            "positions": _capture(lambda: ringseq.positions(8, "zigzag", g)),
            "unshard": _capture(lambda: ringseq.unshard(torch.zeros(1, 4), "zigzag", g)),
            "ring_flash_attn_func": _capture(lambda: ringseq.ring_flash_attn_func(q, q, q, group=g)),
            "ring_flash_attn_qkvpacked_func": _capture(
                lambda: ringseq.ring_flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), group=g)),
            "RingAttention": _capture(lambda: ringseq.RingAttention(group=g)(q, q, q)),
            "ulysses_attn_func": _capture(lambda: ringseq.ulysses_attn_func(q, q, q, group=g)),
            "sharded_cross_entropy": _capture(
                lambda: ringseq.sharded_cross_entropy(torch.randn(1, 4, 5), labels, group=g)),
            "shard_batch": _capture(lambda: ringseq.shard_batch({"input_ids": labels}, group=g)),
        }
    # a Ulysses x ring data layout wrapping packed documents whose boundaries differ on rank 0
    from ringseq.layouts import Documents
    from ringseq.parallel.sp_layout import SequenceParallelLayout
    coords = [(f // 2, f % 2) for f in range(4)]
    docs = SequenceParallelLayout(Documents((0, 16) if rank == 0 else (0, 3, 16)), 2, 2, coords)
    x = torch.arange(16.0)[None]  # (1, 16)
    res["sp_documents"] = _capture(lambda: ringseq.unshard(ringseq.shard(x, docs), docs))
    dist.barrier()
    return res


# ---------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("integrity"))
    return run_ranks(_worker_w2, 2, tmp, timeout=300, env=ENV)


@pytest.fixture(scope="module")
def w4():
    return run_ranks(_worker_w4, 4, timeout=300, env=ENV)


def _is_fast_error(res, kind, *needles):
    assert res[0] == kind, res
    assert res[2] < FAST, f"took {res[2]:.1f} s: {res}"
    for n in needles:
        assert n in res[1], (n, res[1])


@pytest.mark.parametrize("world", [2, 4])
def test_fault_inside_a_call_raises_everywhere_and_breaks_the_ring(w2, w4, world):
    ranks = w2 if world == 2 else w4
    fail_rank = 1 if world == 2 else 2
    for r, res in enumerate(ranks):
        res = res["fault"]
        if r == fail_rank:
            _is_fast_error(res["fault"], "InjectedFault", "injected fault")
            _is_fast_error(res["later"], "RingBrokenError", "reset_ring", "InjectedFault")
        else:
            _is_fast_error(res["fault"], "RingBrokenError", f"rank {fail_rank} failed")
            _is_fast_error(res["later"], "RingBrokenError", "reset_ring")
        _is_fast_error(res["later_again"], "RingBrokenError", "reset_ring")
        assert res["after_reset_err"] < 1e-10


def test_interrupt_inside_a_call_raises_everywhere_at_once(w2):
    for r, res in enumerate(w2):
        if r == 1:
            _is_fast_error(res["interrupt"]["interrupt"], "KeyboardInterrupt", "injected fault")
        else:
            _is_fast_error(res["interrupt"]["interrupt"], "RingBrokenError", "rank 1 failed")
        assert res["interrupt"]["after_reset_err"] < 1e-10


@pytest.mark.parametrize("world", [2, 4])
def test_skipped_backward_is_a_desync_error_on_every_rank(w2, w4, world):
    for res in (w2 if world == 2 else w4):
        _is_fast_error(res["skip_backward"]["skip"], "RingDesyncError", "different ring calls",
                       "backward", "forward")
        assert res["skip_backward"]["after_reset_err"] < 1e-10


@pytest.mark.parametrize("name,needle", [("seqlen", "local seqlen"), ("dtype", "dtype"),
                                         ("causal", "causal"), ("layout", "layout"),
                                         ("scale", "softmax_scale"), ("switch", "layout"),
                                         ("softcap", "softcap (rank 0: 0.0, rank 1: 4e-07)")])
def test_later_argument_changes_raise_instead_of_hanging(w2, name, needle):
    for res in w2:
        _is_fast_error(res["later_change"][name], "RingMismatchError", needle, "rank 1",
                       "ringseq: ring_flash_attn_func: the ranks of the ring were called")
        if name != "switch":
            assert res["later_change"][name + "_after"] < 1e-10


def test_different_document_boundaries_are_shown_by_their_values(w2):
    for res in w2:
        _is_fast_error(res["later_change"]["documents"], "RingMismatchError",
                       "ring_flash_attn_varlen_func: the ranks of the ring were called with "
                       "different arguments: documents (cu_seqlens) (rank 0: [0, 4, 12] "
                       "(3 values), rank 1: [0, 5, 12] (3 values); first difference at index 1)")
        assert res["later_change"]["documents_after"][0] == "ok", res  # the ring is usable


def test_a_scale_the_kernels_see_alike_is_no_mismatch(w2):
    for res in w2:
        assert res["later_change"]["scale_float32_alike"][0] == "ok", res["later_change"]


def test_double_backward_raises(w2):
    for res in w2:
        _is_fast_error(res["double_backward"]["create_graph"], "RuntimeError",
                       "ring_flash_attn_func: differentiating attention twice (create_graph")


def test_double_backward_raises_single_device():
    q, k, v = (t.requires_grad_() for t in _full(12, 20))
    out = ringseq.flash_attn_func(q, k, v, causal=True)
    (gk,) = torch.autograd.grad(out.square().sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^flash_attn_func: differentiating attention twice "
                                           r"\(create_graph"):
        (out.sum() + gk.square().sum()).backward()


@pytest.mark.parametrize("lse_term", [False, True], ids=["out", "out_and_lse"])
def test_double_backward_through_the_raw_kernel_operator_raises(lse_term):
    """torch.ops.ringseq.fwd's gradient is not differentiable: a gradient penalty through it
    raises (before: the second-order term was dropped with only torch's warning, dq off by
    ~5 in float64)."""
    q, k, v = (t.double().requires_grad_() for t in _full(12, 20))
    out, lse = torch.ops.ringseq.fwd(q, k, v, q.shape[-1] ** -0.5, True)
    first = out.square().sum() + (lse.sum() if lse_term else 0)
    (gk,) = torch.autograd.grad(first, k, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^torch.ops.ringseq.(bwd|delta) has no derivative"):
        (out.sum() + gk.square().sum()).backward()
    # its first derivative stays right
    (gk_once,) = torch.autograd.grad(first, k)
    assert torch.equal(gk_once, gk.detach())


def test_concurrent_threads_get_a_clear_error(w2):
    for res in w2:
        t = res["threads"]
        _is_fast_error(t["other"], "RuntimeError", "is bound to thread", "own process group")
        assert t["main_err"] < 1e-10, t
        _is_fast_error(t["named"], "RingMismatchError", "calling thread (rank 0: loader of "
                       "rank 0, rank 1: loader of rank 1). Call from threads of the same name "
                       "on every rank")


def test_failure_before_a_call_opens_raises_on_every_rank_at_once(w2):
    for r, res in enumerate(w2):
        for stage in ("forward", "backward"):
            got = res["before_call"][stage]
            if r == 1:
                _is_fast_error(got, "InjectedFault", "injected fault before the call")
            else:
                _is_fast_error(got, "RingPeerError", "rank 1", "injected fault before the call")
        got = res["before_call"]["ctrl_c"]
        if r == 1:
            _is_fast_error(got, "KeyboardInterrupt", "injected Ctrl-C")
        else:
            _is_fast_error(got, "RingPeerError", "rank 1", "KeyboardInterrupt")
        assert res["before_call"]["after_err"] < 1e-10  # usable without reset_ring


def test_call_tags_fit_the_control_vectors():
    for tag in (2 ** 63, -2 ** 63 - 1, 2 ** 64):
        with pytest.raises(ValueError, match=r"call_tag: tag must fit in int64"):
            with ringseq.call_tag(tag):
                pass
    with ringseq.call_tag(2 ** 63 - 1):
        assert ringseq.engine.integrity.current_tag() == 2 ** 63 - 1


def test_backward_carries_its_forward_call_tag(w2):
    for res in w2:
        kind, err = res["backward_tag"]["backward"][:2]
        assert kind == "ok", res["backward_tag"]
        assert err < 1e-10


@pytest.mark.parametrize("attn", ["ring", "ulysses"])
def test_call_tags_are_compared_with_the_checks_off_too(w2, attn):
    for rank, res in enumerate(w2):
        r = res["tags_checks_off" + ("" if attn == "ring" else "_ulysses")]
        assert r["call"][0] == "RingDesyncError", r
        assert f"(tag {1 + rank})" in r["call"][1] and f"(tag {2 - rank})" in r["call"][1], r
        assert r["after"][0] == "ok" and r["after"][1] < 1e-12, r


@pytest.mark.parametrize("attn", ["ring", "ulysses"])
def test_backwards_run_in_another_order_raise_on_every_rank(w2, attn):
    for res in w2:
        r = res["backward_order" + ("" if attn == "ring" else "_ulysses")]
        for name in "AB":
            assert r[name][0] == "RingMismatchError", r
            assert f"{attn}_" in r[name][1], r  # (the function named)
            assert "its forward (control count) (rank 0: " in r[name][1], r
            assert r[name][1].endswith("run the backwards of alike calls (same shapes and call "
                                       "tag) in the same order on every rank."), r
        assert r["after"][0] == "ok" and r["after"][1] < 1e-12, r


def test_check_consistent_raises_on_every_rank(w2):
    for rank, res in enumerate(w2):
        r = res["check_consistent"]
        assert r["same"] == ("ok", None) and r["after"] == ("ok", None), r
        assert r["flag"] == ("ok", None) and r["flag_differs"][0] == "RingMismatchError", r
        assert r["kind_left_out"] == ("ok", None), r["kind_left_out"]  # ("int" by default)
        if rank == 1:
            assert r["bad_ints"][:2] == ("TypeError", "check_consistent: fields[0] ('docs'): an "
                                         "\"ints\" field's values must be a list of int64 "
                                         "ints, got (0, 5, 18446744073709551616)"), r["bad_ints"]
        else:
            assert r["bad_ints"][0] == "RingPeerError" and r["bad_ints"][2] < FAST, r
        assert r["ints"][0] == "RingMismatchError" and "first difference at index 1" in \
            r["ints"][1], r["ints"]
        assert r["kinds"][0] == "RingMismatchError" and "kinds" in r["kinds"][1], r["kinds"]
        assert r["bad_kind"][:2] == ("ValueError", "check_consistent: fields[0] ('x'): a kind "
                                     "must be one of ['any', 'bool', 'dtype', 'float', 'int', "
                                     "'layout', 'operation'] or a tuple of choices, got 'ints'")
        assert r["values"][1].startswith("ringseq: check_consistent: ") and \
            r["values"][1].endswith("Every rank passes the same values."), r["values"]
        assert r["off_malformed"][0] == ("TypeError" if rank else "ok"), r["off_malformed"]
        assert r["off_next_call"] == ("ok", (1, 8, 2, 8)), r["off_next_call"]
        assert r["values"][0] == "RingMismatchError" and "seqlen (" in r["values"][1], r
        for case in ("count", "names", "text_on_one"):
            assert r[case][0] == "RingMismatchError", r[case]
            assert r[case][1].startswith("check_consistent: the ranks passed other fields "
                                         "(names, kinds, order or count, or a layout field "
                                         "with a text on some ranks only)"), r[case]
        assert r["texts"][0] == "RingMismatchError" and "lay (rank 0: L0, rank 1: L1)" in \
            r["texts"][1], r["texts"]
        assert r["same_texts"][0] == "RingMismatchError" and "lay (rank 0: L (#0), rank 1: L " \
            "(#1))" in r["same_texts"][1], r["same_texts"]
        assert r["bad_text"][:2] == ("TypeError", "check_consistent: fields[0] must be a (name: "
                                     "str, value: int or bool) tuple (with a kind; or (name, "
                                     "value, \"ints\", values), (name, value, \"layout\", text: "
                                     "str)), got ('lay', 0, 'layout', 7)"), r["bad_text"]
        if rank == 1:
            assert r["malformed"][:2] == ("TypeError", "check_consistent: fields[0] must be a "
                                          "(name: str, value: int or bool) tuple (with a kind; "
                                          "or (name, value, \"ints\", values), (name, value, "
                                          "\"layout\", text: str)), got ('seqlen', 'one')")
            assert r["too_many"][:2] == ("ValueError", "check_consistent: at most 24 fields, "
                                         "got 25")
        else:
            for case in ("malformed", "too_many"):
                assert r[case][0] == "RingPeerError" and "rank(s) [1]" in r[case][1], r[case]
        for case in ("values", "count", "names", "malformed", "too_many"):
            assert r[case][2] < FAST, r[case]  # (at once, not after the ring timeout)


def test_a_transport_of_the_users_is_checked_where_it_is_given():
    from ringseq import Transport

    class Loopback(Transport):
        def __init__(self, world_size, rank):
            self.world_size, self.rank = world_size, rank

    q = torch.randn(1, 8, 2, 8)  # (b, s_local, h, d)
    for world, rank, kind in ((0, 0, ValueError), (2, 7, ValueError), (-1, 0, ValueError),
                              (2.0, 0, TypeError)):
        with pytest.raises(kind, match=r"^ring_flash_attn_func: the transport's world_size "):
            ringseq.ring_flash_attn_func(q, q, q, causal=True, group=Loopback(world, rank))
    with pytest.raises(TypeError, match=r"^Ring: transport must be a ringseq.comm.Transport, "
                                        r"got 'x' \(str\)"):
        ringseq.Ring("x")


def test_empty_batch_runs_and_leaves_the_ring_usable(w2):
    for res in w2:
        assert res["empty_batch"] == [("ok", (0, 8, 4, 16))] * 2, res["empty_batch"]


def test_call_tags_belong_to_their_thread():
    from ringseq.engine.integrity import current_tag
    seen = {}

    def other():
        seen["other thread"] = current_tag()
        with ringseq.call_tag(3):
            seen["other thread, inside its block"] = current_tag()

    with ringseq.call_tag(9):
        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        seen["this thread"] = current_tag()
    seen["after the block"] = current_tag()
    assert seen == {"other thread": 0, "other thread, inside its block": 3,
                    "this thread": 9, "after the block": 0}
    with pytest.raises(TypeError, match="call_tag: tag must be an int"):
        with ringseq.call_tag(True):
            pass


def test_fullgraph_compile_of_a_module_with_ring_attention(w2):
    for res in w2:
        assert res["compile"]["diff"] < 1e-10, res["compile"]


def test_checkpoints_are_safe_and_collective(w2):
    for r, res in enumerate(w2):
        c = res["checkpoints"]
        assert c["sched"][0] != "ok" and "sched.pt" in c["sched"][1], c["sched"]
        assert not c["marker"], "a crafted checkpoint ran code"
        if r == 1:  # its own error type, with rank and path
            assert c["load"][0] == "UnpicklingError" and "rank 1" in c["load"][1] \
                and "node_copy.pt" in c["load"][1], c["load"]
        else:
            assert c["load"][0] == "ValueError" and "another rank" in c["load"][1] \
                and "failed rank(s): [1]" in c["load"][1], c["load"]
        assert c["unchanged"]
        assert c["victim"] == "precious" and c["saved_ok"]


def test_destroyed_groups_do_not_keep_their_rings(w2):
    for res in w2:
        assert res["many_groups"]["kept"] <= 1, res["many_groups"]


def test_destroyed_double_ring_groups_do_not_keep_their_rings(w4):
    # (before: the double ring's cached outer plans held its inner and outer rings, and their
    # exchange buffers, past the groups' destruction: 6 of these 9 rings)
    for res in w4:
        c = res["many_double_rings"]
        assert c["rings"] == 9 and c["kept"] == 0, c
        assert c["max_err"] < 1e-9, c


def test_stalled_peer_times_out_with_a_ringseq_message(w2):
    res = w2[0]["stalled"]["stalled"]
    assert res[0] == "RingTimeoutError" and "ringseq" in res[1] and "peers" in res[1], res
    assert res[2] < 10, res
    res = w2[0]["stalled"]["unshard_backward"]
    assert res[0] == "RingTimeoutError" and "at unshard backward agreement #" in res[1], res
    assert res[2] < 10, res


def test_booster_step_failing_on_one_rank(w2):
    for r, res in enumerate(w2):
        b = res["booster"]
        assert b["good"][0] == "ok", b["good"]
        if r == 1:
            assert b["bad"][0] == "IndexError", b["bad"]
        else:
            _is_fast_error(b["bad"], "RingBrokenError", "rank 1 failed")
        assert b["next"][0] != "ok" and b["next"][2] < FAST, b["next"]
        assert "reset_ring" in b["next"][1] or "reset" in b["next"][1], b["next"]
        assert b["after_reset"][0] == "ok", b["after_reset"]
    # replicas are identical again: the same loss on every rank
    assert w2[0]["booster"]["after_reset"][1] == w2[1]["booster"]["after_reset"][1]


def _nan_reference(layout, what, w):
    s = 8 * w
    full = _full(10, s, dtype=torch.float32)
    which, value = {"k_nan": (1, float("nan")), "v_nan": (2, float("nan")),
                    "q_inf": (0, float("inf"))}[what]
    full[which][0, 5 * s // 8, 0, 3] = value
    q, k, v = (t.double() for t in full)
    # plain causal attention without any NaN guard, summing over the keys each row attends to
    # (a masked key's NaN value must not reach rows that never see it: 0 * NaN is NaN)
    kk, vv = (t.repeat_interleave(q.shape[2] // k.shape[2], 2) for t in (k, v))
    visible = ~torch.ones(s, s, dtype=torch.bool).triu(1)  # (q, k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)  # (b, h, q, k)
    terms = p[..., None] * vv.permute(0, 2, 1, 3)[:, :, None]  # (b, h, q, k, d)
    strict = terms.masked_fill(~visible[None, None, :, :, None], 0.0).sum(3).transpose(1, 2)
    # softmax(S) @ V as plain attention writes it: 0 * NaN also poisons rows that do not see
    # the key, an upper bound of what a kernel that multiplies whole tiles may show
    plain = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return [[ringseq.layouts.shard_local(t, layout, w, r) for r in range(w)]
            for t in (strict, plain)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("what", ["k_nan", "v_nan", "q_inf"])
def test_nan_and_inf_propagate_like_plain_attention(w4, layout, what):
    strict, plain = _nan_reference(layout, what, 4)
    n_bad = 0
    for r, res in enumerate(w4):
        got_bad = ~torch.isfinite(res["nan"][layout][what])
        must, may = ~torch.isfinite(strict[r]), ~torch.isfinite(plain[r])
        # every output that attends to the poisoned value is poisoned, on every rank ...
        assert not (must & ~got_bad).any(), (r, layout, what, "a poisoned value was dropped")
        # ... and nothing beyond what plain attention itself would poison
        assert not (got_bad & ~may).any(), (r, layout, what)
        n_bad += int(must.any())
        fin = ~got_bad
        assert max_err(res["nan"][layout][what][fin], strict[r][fin]) < 1e-4
    # a poisoned key/value reaches the ranks after its own; a poisoned query only its row
    assert n_bad >= (1 if what == "q_inf" else 2)


def test_fuzzed_faults_never_give_silently_wrong_results(w4):
    for r, res in enumerate(w4):
        counts = res["fuzz"]
        assert counts["wrong"] == 0, counts
        assert counts["error"] > 0 and counts["correct"] > 0, counts
    assert sum(res["fuzz"]["faults"] for res in w4) >= 25


def test_unshard_of_shards_that_differ_raises_on_every_rank(w2):
    for rank, res in enumerate(w2):
        got = res["unshard"]
        _is_fast_error(got["shape"], "RingMismatchError", "shape[1] (rank 0: 6, rank 1: 4)")
        _is_fast_error(got["dtype"], "RingMismatchError", "dtype (rank 0: torch.float32, rank 1: torch.float64)")
        _is_fast_error(got["layout"], "RingMismatchError", "layout (rank 0: 'zigzag', rank 1: 'stripe')")
        _is_fast_error(got["int8_uint8"], "RingMismatchError",
                       "dtype (rank 0: torch.int8, rank 1: torch.uint8)")
        # rank 1's 3 rows cannot be a zigzag shard (two halves): its own ValueError there, a
        # RingPeerError naming it on rank 0
        for key, own in (("odd_zigzag", ""), ("typo", "zigzg"), ("bad_dim", "dim=3")):
            if rank == 1:
                _is_fast_error(got[key], "ValueError", own)
            else:  # (with rank 1's message: before, "see their errors")
                _is_fast_error(got[key], "RingPeerError", "rank(s) [1] of the group failed "
                                                          "where this rank did not (rank 1: ")
                assert own in got[key][1], got[key]
        _is_fast_error(got["backward_order"], "RingMismatchError",
                       "unshard (backward): the ranks of the ring were called with different "
                       "arguments: unshard call (its forward's agreement) (rank 0: ")
        _is_fast_error(got["duplicates"], "ValueError",
                       "unshard: layout 'every_rank_first': _positions(12, 2, rank) over the "
                       "ranks must list every position of [0, 12) exactly once")
        want = ringseq.layouts.unshard_local([torch.arange(12.0).reshape(1, 6, 2) + 100 * r for r in range(2)],
                                     "zigzag")
        assert torch.equal(got["after"], want)


def test_unshard_compares_a_wrapped_layouts_documents(w4):
    """A Ulysses x ring layout's code includes its base layout's (packed documents' boundaries
    are not in the name): ranks whose documents differ raise instead of returning a mix."""
    for res in w4:
        _is_fast_error(res["sp_documents"], "RingMismatchError", "layout (rank 0: ")


def test_non_member_ranks_get_an_error_naming_the_function_called(w4):
    for r, res in enumerate(w4[2:], start=2):
        for fn, got in res["non_member"].items():
            assert got[0] == "ValueError", (fn, got)
            assert got[1].startswith(f"{fn}: this process (global rank {r}) is not a member"), \
                (fn, got)


def test_unknown_consistency_mode_in_the_environment(monkeypatch):
    from ringseq import _dist
    monkeypatch.setenv("RINGSEQ_CHECK_CONSISTENCY", "alwasy")
    monkeypatch.setattr(_dist, "_CHECK_MODE", None)
    with pytest.raises(ValueError, match="alwasy.*always"):
        _dist.consistency_check_mode()
    monkeypatch.setenv("RINGSEQ_CHECK_CONSISTENCY", "none")
    with pytest.raises(ValueError, match="'none'"):
        _dist.consistency_check_mode()


def test_a_control_timeout_names_the_agreement_it_waited_in():
    # (before: "at the argument check step of control operation #7" for every agreement: a
    # stalled loss or optimizer-step agreement read as an attention argument check)
    from ringseq.engine.integrity import (CHECK, FWD, _message_words, agreement_code,
                                          call_tag, control_name, control_vector)
    with call_tag(3):
        words = control_vector(CHECK, 0, 7, about=agreement_code("loss"))
    assert control_name(words, CHECK, 7) == "loss agreement #7 (tag 3)"
    assert control_name(control_vector(FWD, 0, 8), FWD, 8) == "forward #8"
    # a message's bytes are no control vector: named by the kind alone
    assert control_name(_message_words("rank 1 failed"), FWD, 9) == \
        "the forward step of control operation #9"


class _ListedControl:
    """A ring for ``_listed_values``: its control exchange returns this rank's words (rank 0)
    and the words each peer would send for its list in ``peers``."""

    def __init__(self, *peers):
        self._seq, self.peers = 0, peers

    def control(self, words, kind, seq):
        import torch

        from ringseq.engine.integrity import CONTROL_WORDS, _LISTED
        rows = [words]
        for values in self.peers:
            shown = list(values)[:_LISTED]
            tail = [len(values)] + shown + [0] * (_LISTED - len(shown))
            rows.append(torch.cat([words[:CONTROL_WORDS], torch.tensor(tail, dtype=torch.int64)]))
        return torch.stack(rows)


@pytest.mark.parametrize("mine, peers, shown", [
    ([0, 4, 12], [0, 5, 12],
     "rank 0: [0, 4, 12] (3 values), rank 1: [0, 5, 12] (3 values); first difference at index 1"),
    ([8], [], "rank 0: [8] (1 value), rank 1: [] (0 values); first difference at index 0"),
    (list(range(0, 400, 4)), list(range(0, 200, 4)) + [201] + list(range(204, 400, 4)),
     "rank 0: [..., 192, 196, 200, 204, 208, ...] (100 values), rank 1: [..., 192, 196, 201, "
     "204, 208, ...] (100 values); first difference at index 50"),
    (list(range(100)), list(range(99)) + [7],
     "rank 0: [..., 62, 63, ...] (100 values), rank 1: [..., 62, 63, ...] (100 values); the "
     "first 64 agree; alike after them: rank(s) [0] / rank(s) [1]"),
    (list(range(100)), list(range(101)),
     "rank 0: [..., 62, 63, ...] (100 values), rank 1: [..., 62, 63, ...] (101 values); the "
     "first 64 agree; alike after them: rank(s) [0] / rank(s) [1]")])
def test_a_mismatched_list_is_shown_around_its_first_difference(mine, peers, shown):
    # (document boundaries and kv-cache lengths: before, their hashes were shown)
    from ringseq._hash import stable_hash_ints
    from ringseq.engine.integrity import _listed_values
    hashes = [stable_hash_ints(mine), stable_hash_ints(peers)]
    assert _listed_values(_ListedControl(peers), mine, lambda r: f"rank {r}", hashes) == shown


def test_lists_differing_past_the_64th_value_name_the_rank_that_differs():
    # (W = 4, rank 2's list differs at value 80: before, all four ranks' shown values and
    # counts were alike and no rank was named; helper-123)
    from ringseq.engine.integrity import _listed_values
    alike = list(range(101))
    hashes = [11, 11, 22, 11]
    shown = _listed_values(_ListedControl(alike, alike, alike), alike, lambda r: f"rank {r}",
                           hashes)
    assert shown.endswith("the first 64 agree; alike after them: rank(s) [0, 1, 3] / "
                          "rank(s) [2]"), shown


def _desync_relayed_with_the_checks_off():
    """With the checks off, W=4: rank 2 alone on another layout (a plain ring), then rank 1
    alone under another call tag (Ulysses 2 x ring 2); then, reset, an exact call."""
    rank = dist.get_rank()
    full = _full(11, 32)
    res = {}
    ringseq.set_consistency_check(False)
    try:
        layout = "zigzag" if rank == 2 else "contiguous"
        loc = [ringseq.shard(t, layout) for t in full]
        res["layout"] = _capture(lambda: ringseq.ring_flash_attn_func(*loc, causal=True,
                                                                       layout=layout))
        ringseq.reset_ring()
        sp = ringseq.make_sp_groups(2)
        loc = [sp.shard(t, "zigzag") for t in full]
        with ringseq.call_tag(101 if rank == 1 else 100):
            res["tag"] = _capture(lambda: ringseq.usp_attn_func(*loc, causal=True, sp=sp,
                                                                layout="zigzag"))
        sp.reset()
        want = sp.shard(ringseq.flash_attn_func(*full, causal=True, backend="reference"),
                        "zigzag")
        res["after"] = _capture(lambda: max_err(ringseq.usp_attn_func(
            *loc, causal=True, sp=sp, layout="zigzag"), want))
    finally:
        ringseq.set_consistency_check(True)
    return res


def test_a_desync_reaches_every_rank_with_the_checks_off():
    """A rank that saw a desynchronized header marks what it sends on, so the ranks after it
    raise too (before: with rank 2 on another layout, ranks 0 and 1 returned outputs 0.66 and
    0.47 off without a word; under the hybrid, a tag differing on rank 1 left rank 2 0.67 off,
    the zeros of a rank whose inner ring had raised taken as its part)."""
    for rank, r in enumerate(run_ranks(_desync_relayed_with_the_checks_off, 4, timeout=120)):
        for case in ("layout", "tag"):
            assert r[case][0] == "RingDesyncError", (rank, case, r[case])
        if rank in (0, 1):  # (after rank 3, which received rank 2's header)
            assert "marked as sent after it, or a rank before it, saw the ring " \
                   "desynchronized" in r["layout"][1], r["layout"]
        assert r["after"][0] == "ok" and r["after"][1] < 1e-12, (rank, r["after"])
