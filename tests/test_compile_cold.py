"""``torch.compile(fullgraph=True)`` of every public attention function works from a cold start;
``torch.export`` with a symbolic length, strict or not.

Each of 2 freshly spawned gloo ranks compiles the ring function as its very first ringseq call
(default Inductor backend: nothing the traced path touches may be created lazily), then every
other public function (``aot_eager``: the same Dynamo trace and autograd graph without
Inductor's code generation, to keep the test short), forward and backward, and compares each
with the eager call.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

S, H, HKV, D = 16, 4, 2, 8


def _worker():
    import ringseq
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    q = torch.randn(1, S, H, D)
    k = torch.randn(1, S, HKV, D)
    v = torch.randn(1, S, HKV, D)
    sp = None

    def cases():
        nonlocal sp
        cu = [0, 5, 16]
        yield "ring_flash_attn_func", lambda q, k, v: ringseq.ring_flash_attn_func(
            q, k, v, causal=True, layout="zigzag")
        yield "flash_attn_func", lambda q, k, v: ringseq.flash_attn_func(
            q, k, v, causal=True, window_size=(3, 0), softcap=2.0)
        yield "flash_attn_kvpacked_func", lambda q, k, v: ringseq.flash_attn_kvpacked_func(
            q, torch.stack([k, v], 2), causal=True)
        yield "flash_attn_qkvpacked_func", lambda q, k, v: ringseq.flash_attn_qkvpacked_func(
            torch.stack([q, q, q], 2), causal=True)
        yield "flash_attn_varlen_func", lambda q, k, v: ringseq.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 11, 11, causal=True)
        yield "flash_attn_varlen_kvpacked_func", lambda q, k, v: \
            ringseq.flash_attn_varlen_kvpacked_func(q[0], torch.stack([k[0], v[0]], 1), cu, cu,
                                                    11, 11, causal=True)
        yield "flash_attn_varlen_qkvpacked_func", lambda q, k, v: \
            ringseq.flash_attn_varlen_qkvpacked_func(torch.stack([q[0]] * 3, 1), cu, 11)
        yield "ring_flash_attn_kvpacked_func", lambda q, k, v: \
            ringseq.ring_flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True)
        yield "ring_flash_attn_qkvpacked_func", lambda q, k, v: \
            ringseq.ring_flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), causal=True)
        yield "ring_flash_attn_varlen_func", lambda q, k, v: \
            ringseq.ring_flash_attn_varlen_func(q[0], k[0], v[0], [0, 9, 2 * S], causal=True)
        yield "zigzag_ring_flash_attn_func", lambda q, k, v: \
            ringseq.zigzag_ring_flash_attn_func(q, k, v, causal=True)
        yield "stripe_flash_attn_func", lambda q, k, v: \
            ringseq.stripe_flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
        yield "ring_sdpa", lambda q, k, v: ringseq.ring_sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        yield "RingAttention", ringseq.RingAttention(layout="stripe", causal=True)
        yield "ulysses_attn_func", lambda q, k, v: ringseq.ulysses_attn_func(
            q, k, v, causal=True, window_size=(5, 0))
        sp = ringseq.make_sp_groups(2)
        yield "usp_attn_func", lambda q, k, v: ringseq.usp_attn_func(
            q, k, v, causal=True, sp=sp, softcap=3.0)
        yield "usp_sdpa", lambda q, k, v: ringseq.usp_sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, sp=sp)

    results = {}
    every = list(cases())
    # dynamic=True as well, where head counts are symbolic too (before: the Ulysses forms' gcd
    # of head counts failed the trace)
    dynamic = [(f"{name} dynamic", fn, True) for name, fn in every
               if name in ("ring_flash_attn_func", "ulysses_attn_func", "usp_attn_func",
                           "usp_sdpa")]
    for i, (name, fn, dyn) in enumerate([(n, f, False) for n, f in every] + dynamic):
        first = i == 0  # the process's first ringseq call: a cold compile with Inductor
        compiled = torch.compile(fn, fullgraph=True, dynamic=dyn or None,
                                 backend="inductor" if first else "aot_eager")
        torch._dynamo.reset()
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        got = compiled(*ins)
        got.float().sum().backward()
        grads = [t.grad for t in ins]
        ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
        want = fn(*ref_ins)
        want.float().sum().backward()
        # (a gradient missing on one side only is a failure: before, it was skipped, and a
        # compiled path that dropped k's and v's gradients scored 0; the packed forms use q
        # alone, on both sides)
        err = max([float((got - want).abs().max())]
                  + [float("inf") if (a is None) != (b is None) else
                     0.0 if a is None else float((a - b).abs().max())
                     for a, b in zip(grads, [t.grad for t in ref_ins])])
        results[name] = err
    return results


def test_every_public_function_compiles_cold_with_fullgraph():
    per_rank = run_ranks(_worker, 2, timeout=600)
    for rank, res in enumerate(per_rank):
        assert len(res) == 17 + 4, sorted(res)  # (every public function, 4 of them dynamic)
        for name, err in res.items():
            assert err < 1e-5, f"rank {rank} {name}: compiled differs from eager by {err}"


def test_compiled_calls_keep_their_graph_and_compose_with_dynamic_shapes_and_checkpointing():
    """One process, fullgraph=True throughout: repeated calls at one shape reuse the graph
    (before: a validation counter the trace mutated made every call recompile, and fullgraph
    failed at the 9th call); dynamic=True traces the default soft-cap (a symbolic float there;
    before: math.isfinite failed the trace); activation checkpointing around the operator
    compiles (before: refused as a side effect); an empty batch's backward under dynamic
    shapes runs (before: its strides-0 gradient was refused). Each equals the eager call."""
    import ringseq
    from torch.utils.checkpoint import checkpoint

    def attn(q, k, v):
        return ringseq.flash_attn_func(q, k, v, causal=True)

    def grads_of(fn, *shape):
        g = torch.Generator().manual_seed(shape[1])
        ins = [torch.randn(*shape, generator=g).requires_grad_() for _ in range(3)]
        out = fn(*ins)
        out.sum().backward()
        return [out.detach()] + [t.grad for t in ins]

    torch._dynamo.reset()
    same = torch.compile(attn, fullgraph=True, backend="aot_eager")
    grads_of(same, 1, S, H, D)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(10):
            got = grads_of(same, 1, S, H, D)
    cases = [("same shape", got, grads_of(attn, 1, S, H, D))]
    dynamic = torch.compile(attn, fullgraph=True, dynamic=True, backend="aot_eager")
    for s in (12, 20, 36):  # (no length equal to the head dim: duck sizing would recompile)
        cases.append((f"dynamic s={s}", grads_of(dynamic, 2, s, H, D), grads_of(attn, 2, s, H, D)))
    ckpt = torch.compile(lambda q, k, v: checkpoint(attn, q, k, v, use_reentrant=False),
                         fullgraph=True, backend="aot_eager")
    cases.append(("checkpointed", grads_of(ckpt, 1, S, H, D), grads_of(attn, 1, S, H, D)))
    cases.append(("empty batch", grads_of(dynamic, 0, S, H, D), grads_of(attn, 0, S, H, D)))
    for name, got, want in cases:
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), name


def test_varlen_max_seqlen_may_be_symbolic_under_fullgraph():
    """flash_attn_varlen_func's max_seqlen traced as a SymInt (dynamic=True, or the second call
    of another length) compiles with fullgraph (a NumPy-integer check that read it as any
    other integer failed the trace: "Unsupported hasattr call"); equal to eager."""
    import ringseq

    def attn(q, k, v, cu, mx):
        return ringseq.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)

    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(attn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
        for cu, mx in (([0, 5, 16], 11), ([0, 7, 20], 13)):
            g = torch.Generator().manual_seed(mx)
            q, k, v = (torch.randn(cu[-1], H, D, generator=g) for _ in range(3))
            assert torch.equal(compiled(q, k, v, cu, mx), attn(q, k, v, cu, mx)), (dynamic, mx)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"window_size": (3, 0)}, {"softcap": 2.0}])
def test_export_with_a_dynamic_length_runs_every_length(strict, kwargs):
    """torch.export of a module calling flash_attn_func, with a symbolic sequence length: the
    exported program equals the eager call at lengths it was not traced at. Non-strict tracing
    (export's default) with a window failed before ("specialized to a constant"): the window's
    span was built at the call from the length as a Python int; now at run time."""
    import ringseq

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return ringseq.flash_attn_func(q, k, v, causal=True, **kwargs)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, h, D, generator=gen) for h in (H, HKV, HKV))
    seq = torch.export.Dim("seq", min=4, max=64)
    program = torch.export.export(Attention(), (q, k, v), dynamic_shapes=({1: seq},) * 3,
                                  strict=strict)
    for s in (5, 17, 40):
        q, k, v = (torch.randn(1, s, h, D, generator=gen) for h in (H, HKV, HKV))
        assert torch.equal(program.module()(q, k, v), Attention()(q, k, v)), s


def test_a_tensor_of_boundaries_under_fullgraph_is_named():
    """cu_seqlens as a tensor cannot be read while dynamo traces: under fullgraph=True the
    error names the argument and the way out (before: dynamo's "Could not guard on
    data-dependent expression" only); without fullgraph the call runs, as eager, and the
    code around it stays compiled (a graph break, not a skipped frame)."""
    import ringseq
    q = torch.randn(16, H, D, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)

    def attn(q):
        return ringseq.flash_attn_varlen_func(q, q, q, cu, cu, 11, 11, causal=True)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"ringseq reads document boundaries \(cu_seqlens\) "
                                        r"given as a tensor on the host, .* pass them as a "
                                        r"list of ints"):
        torch.compile(attn, fullgraph=True, backend="aot_eager")(q)

    def around(q):  # the code around the call: compiled
        return torch.sigmoid(attn(torch.relu(q))) * 2

    graphs = []

    def count(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    assert torch.equal(torch.compile(around, backend=count)(q), around(q))
    captured = {getattr(t, "__name__", str(t)) for g in graphs for t in g}
    assert {"relu", "sigmoid"} <= captured, graphs


def _worker_user_layout():
    import ringseq
    from custom_layout import ReversedContiguous

    lay = ReversedContiguous()  # (fresh: none of its checks cached by an eager call)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D) for _ in range(3))

    def attention(q, k, v):
        return ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=lay)
    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v)
    return float((compiled - attention(q, k, v)).abs().max())


def test_a_user_layout_compiles_with_fullgraph_as_the_first_call():
    """(before: the permutation check of a user's layout, traced, failed on data-dependent
    bincount / nonzero)"""
    assert all(err == 0.0 for err in run_ranks(_worker_user_layout, 2, timeout=240))


def _worker_sp_modes_dynamic():
    import ringseq
    from ringseq.engine.ring import _RINGS
    out = {}
    for name, sp in (("hybrid 2x2", ringseq.make_sp_groups(2)),
                     ("double ring 2x2", ringseq.make_sp_groups(1, 2)),
                     ("ulysses 4", ringseq.make_sp_groups(4))):
        for h, h_kv in ((4, 1), (8, 2)):  # (a new trace each: the second traces again)
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 8, n, 8, requires_grad=True) for n in (h, h_kv, h_kv))

            def attention(q, k, v):
                return ringseq.usp_attn_func(q, k, v, causal=True, sp=sp, layout="zigzag")
            torch._dynamo.reset()
            compiled = torch.compile(attention, fullgraph=True, dynamic=True,
                                     backend="aot_eager")
            got, want = compiled(q, k, v), attention(q, k, v)
            grads = [torch.autograd.grad(o.sum(), (q, k, v)) for o in (got, want)]
            out[f"{name} {h}/{h_kv}"] = max([float((got - want).abs().max())] +
                                            [float((a - b).abs().max()) for a, b in zip(*grads)])
    # one ring per process group, none for the wrappers tracing passes them in
    out["rings of tracing wrappers"] = sum(type(key).__name__ == "FakeScriptObject"
                                          for key in _RINGS.keys())
    return out


def test_sequence_parallel_modes_compile_again_and_again_with_dynamic_shapes():
    """Hybrid, double ring and Ulysses, each traced twice (fullgraph, dynamic=True), equal
    their eager calls. (Before: the groups' ring size was traced as a symbolic int, and the
    layout check failed on it, "Unsupported hasattr call ... 2*s60", on every rank; and each
    trace keyed a new ring by the wrapper its process group arrived in, whose channels met an
    earlier one's under the same names: RingTimeoutError on every rank at the sixth call.)"""
    for res in run_ranks(_worker_sp_modes_dynamic, 4, timeout=300):
        assert set(res.values()) == {0.0} and len(res) == 7, res


def test_a_malformed_user_layout_is_refused_compiled_as_eagerly():
    """Its checks run where the ring plans the call, at run time (before: skipped while
    compiling, a task past the shard dropped keys without a word; traced, they broke the
    graph)."""
    import ringseq
    from ringseq.layouts import BlockTask, Contiguous

    class TooLong(Contiguous):
        name = "test_too_long_compiled"

        def _tasks(self, rank, src, world_size, s):
            return [BlockTask(slice(0, s), slice(0, s + 4), True)] if src == rank else []

    q = torch.randn(1, S, H, D)
    for fullgraph in (True, False):
        lay = TooLong()  # (fresh: nothing cached)
        torch._dynamo.reset()
        attention = torch.compile(lambda q: ringseq.ring_flash_attn_func(
            q, q, q, causal=True, layout=lay), fullgraph=fullgraph, backend="aot_eager")
        with pytest.raises(ValueError, match=r"^ring_flash_attn_func: layout "
                                             r"'test_too_long_compiled': _tasks\(0, 0, 1, 16\) "
                                             r"must return tasks whose q "):
            attention(q)


@pytest.mark.parametrize("backend", ["ringseq", "reference"])
def test_a_backend_given_by_name_compiles_with_fullgraph(backend):
    """(Before: "Import failure | module_name: flash_attn" where flash-attn is not installed:
    the names of the other backends were listed, importing flash_attn, on every call.)"""
    import ringseq
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D) for _ in range(3))

    def fn(q, k, v):
        return ringseq.flash_attn_func(q, k, v, causal=True, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, fn(q, k, v))
