"""The ops layer: flash_attn_func, backends, input validation, torch.library integration."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringseq
from ringseq.kernels import extension_available, get_backend

from utils import assert_close_per_design, default_floor, reference_grads, scaled_floor

needs_ext = pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")
CPU_BACKENDS = ["ringseq", "sdpa", "reference"]


def qkv(b=2, s_q=33, s_k=33, h=4, h_kv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h, d, generator=g).to(dtype)
    k = torch.randn(b, s_k, h_kv, d, generator=g).to(dtype)
    v = torch.randn(b, s_k, h_kv, d, generator=g).to(dtype)
    return q, k, v


# ---------------------------------------------------------------- errors, one per mistake
def _bad_inputs():
    q, k, v = qkv()
    yield "q dims", (q[0], k, v), "q must be a 4-dim tensor"
    yield "k dims", (q, k[0], v), "k must be a 4-dim tensor"
    yield "batch", (q, k[:1], v[:1]), "same batch size"
    yield "head dim", (q, k[..., :8], v[..., :8]), "same head dim"
    yield "dtype", (q, k.double(), v), "same dtype"
    yield "k v shape", (q, k, v[:, :5]), "k and v must have the same shape"
    yield "head divisibility", (q[:, :, :3], k, v), "divisible by nheads_kv"
    yield "last dim contiguous", (q.transpose(1, 3).contiguous().transpose(1, 3), k, v),
    yield "dtype support", (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32)), "float32"


BAD = list(_bad_inputs())
BAD = [c if len(c) == 3 else (c[0], c[1], "contiguous in its last") for c in BAD]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_flash_attn_func_rejects_bad_input(case, backend):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    _, args, message = case
    with pytest.raises(ValueError, match=message):
        ringseq.flash_attn_func(*args, backend=backend)


@needs_ext
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_extension_op_rejects_bad_input(case):
    _, args, message = case
    if message == "float32":
        message = "supports float32, float64, bfloat16 and float16"
    with pytest.raises(ValueError, match=message):
        torch.ops.ringseq.fwd(*args, 0.25, False)


def test_tensors_without_data_are_named():
    q, k, v = qkv()  # (meta tensors: a kernel would read garbage)
    with pytest.raises(ValueError, match=r"^flash_attn_func: .*got k, v on the meta device"):
        ringseq.flash_attn_func(q, k.to("meta"), v.to("meta"))
    # q on the meta device too (before: autocast's "unknown device type" RuntimeError)
    meta = [t.to("meta") for t in (q, k, v)]
    # (ring_sdpa names SDPA's query, key, value)
    for fn, names, call in (
            ("ring_sdpa", "query, key, value",
             lambda: ringseq.ring_sdpa(*(t.transpose(1, 2) for t in meta))),
            ("ring_flash_attn_func", "q, k, v", lambda: ringseq.ring_flash_attn_func(*meta))):
        with pytest.raises(ValueError, match=rf"^{fn}: .*got {names} on the meta device"):
            call()


def test_unknown_backend_is_named():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backend must be one of"):
        ringseq.flash_attn_func(q, k, v, backend="xformers")


@pytest.mark.parametrize("option", [dict(layout=3), dict(layout=None), dict(backend=3),
                                    dict(grad_comm_dtype=3)])
def test_options_of_the_wrong_kind_are_type_errors(option):
    """docs/design.md: a value of the wrong kind is a TypeError, an unknown value of the
    right kind a ValueError (before: ValueError "unknown layout 3")."""
    q = torch.randn(1, 8, 2, 16)
    name = next(iter(option))
    with pytest.raises(TypeError, match=rf"^ring_flash_attn_func: {name} must be "):
        ringseq.ring_flash_attn_func(q, q, q, **option)


def test_flash_attn_backend_refuses_cpu_tensors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="flash_attn"):
        ringseq.flash_attn_func(q, k, v, backend="flash_attn")


@needs_ext
def test_cuda_support_is_stated():
    """On CUDA our kernel takes fp16/bf16 with head dim 64 or 128 (or was not built)."""
    with pytest.raises(ValueError, match="float16 and bfloat16|without CUDA"):
        get_backend("ringseq", "cuda", torch.float32, 64)
    with pytest.raises(ValueError, match="head dims 64 and 128|without CUDA"):
        get_backend("ringseq", "cuda", torch.bfloat16, 96)


@needs_ext
def test_backward_op_rejects_bad_statistics():
    q, k, v = qkv()
    out, lse = torch.ops.ringseq.fwd(q, k, v, 0.25, False)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="lse must have shape"):
        torch.ops.ringseq.bwd(dout, q, k, v, out, lse[:, :, :-1], 0.25, False)
    with pytest.raises(ValueError, match="lse must be Float"):
        torch.ops.ringseq.bwd(dout, q, k, v, out, lse.double(), 0.25, False)
    with pytest.raises(ValueError, match="dout must have the shape of q"):
        torch.ops.ringseq.bwd(dout[:, :-1], q, k, v, out, lse, 0.25, False)
    acc = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    with pytest.raises(ValueError, match="dq_accum must be Float"):
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, None, *acc)


@needs_ext
def test_accumulators_must_not_share_memory():
    """The accumulating ops write into their accumulators from several work items: an expanded
    view (two elements at one address) or one that shares memory with an input is refused."""
    q, k, v = qkv()
    out, lse = torch.ops.ringseq.fwd(q, k, v, 0.25, False)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    expanded = torch.zeros(2, 33, 1, 16).expand(2, 33, 2, 16)  # dk's shape, one row per 2 heads
    with pytest.raises(ValueError, match="dk_accum has elements that share memory"):
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, None, dq, expanded, dv)
    # (dense views of another tensor's memory; torch decides overlap for dense layouts only,
    # as its own in-place ops do)
    def within(t, like):
        return t.view(-1)[:like.numel()].view(like.shape)

    with pytest.raises(ValueError, match="dv_accum shares memory with dout"):
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, None, dq, dk, within(dout, dv))
    with pytest.raises(ValueError, match="dq_accum shares memory with dk_accum"):
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, None, dq, within(dq, dk), dv)
    with pytest.raises(ValueError, match="dq_accum shares memory with delta"):
        torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, within(dq, lse), dq, dk, dv)
    out_acc, lse_acc = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    with pytest.raises(ValueError, match="out_acc shares memory with q"):
        torch.ops.ringseq.fwd_accum(q, k, v, 0.25, False, q, lse_acc)
    with pytest.raises(ValueError, match="lse_acc has elements that share memory"):
        torch.ops.ringseq.fwd_accum(q, k, v, 0.25, False, out_acc, lse_acc[:, :1].expand_as(lse_acc))
    # separate tensors of the right shapes still run
    torch.ops.ringseq.fwd_accum(q, k, v, 0.25, False, out_acc, lse_acc)
    torch.ops.ringseq.bwd_accum(dout, q, k, v, out, lse, 0.25, False, None, dq, dk, dv)
    torch.testing.assert_close(out_acc, out)


# ---------------------------------------------------------------- backends agree with float64
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("s_q,s_k,causal", [(33, 33, True), (33, 33, False), (40, 17, True),
                                            (17, 40, True), (17, 40, False)])
def test_backends_match_reference(backend, s_q, s_k, causal):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    q, k, v = qkv(s_q=s_q, s_k=s_k)
    dout = torch.randn(q.shape)
    ref = reference_grads(q, k, v, dout, causal=causal)
    plain = reference_grads(q, k, v, dout, causal=causal, dtype=torch.float32)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringseq.flash_attn_func(qg, kg, vg, causal=causal, return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    for name, got, r, p, factor in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref,
                                       plain, (2, 2, 3, 3, 3)):
        assert_close_per_design(got, r, p, f"{backend} {name}", factor, default_floor(torch.float32))


@pytest.mark.parametrize("backend", ["ringseq", "reference"])
def test_gradient_flows_through_lse(backend):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    q, k, v = qkv(s_q=20, s_k=29, dtype=torch.float64)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringseq.flash_attn_func(qg, kg, vg, causal=True, return_lse=True, backend=backend)
    w = torch.randn_like(lse.masked_fill(torch.isinf(lse), 0))
    loss = out.square().sum() + (lse.masked_fill(torch.isinf(lse), 0) * w).sum()
    got = torch.autograd.grad(loss, (qg, kg, vg))
    from utils import attention_reference
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o_r, l_r = attention_reference(qr, kr, vr, causal=True)
    loss_r = o_r.square().sum() + (l_r.masked_fill(torch.isinf(l_r), 0) * w).sum()
    want = torch.autograd.grad(loss_r, (qr, kr, vr))
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=1e-9, atol=1e-10)


def test_sdpa_backend_refuses_gradient_through_lse():
    q, k, v = qkv()
    qg = q.clone().requires_grad_()
    _, lse = ringseq.flash_attn_func(qg, k, v, return_lse=True, backend="sdpa")
    with pytest.raises(RuntimeError, match="cannot backpropagate through lse"):
        lse.sum().backward()
    # called directly, the backend names its own function
    be = get_backend("sdpa")
    out, lse = be.fwd(q, k, v, 0.25, False)
    with pytest.raises(RuntimeError, match=r"^sdpa\.bwd: backend 'sdpa' cannot backpropagate "):
        be.bwd(out, q, k, v, out, lse, 0.25, False, delta=torch.zeros_like(lse))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_key_sequence_gives_zero_and_neg_inf(backend):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    q, k, v = qkv(s_k=0)
    out, lse = ringseq.flash_attn_func(q, k, v, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.isneginf(lse).all() and lse.shape == (2, 4, 33)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_inputs_stay_in_the_autograd_graph(backend):
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    q, k, v = (t.requires_grad_() for t in qkv(s_k=0))
    out = ringseq.flash_attn_func(q, k, v, backend=backend)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape


def test_default_backend_is_ours_on_cpu():
    want = "ringseq" if extension_available() else "reference"
    assert get_backend(None, "cpu", torch.float32, 64).name == want


def test_default_backend_on_cuda_can_compute_the_call():
    """The choice only (no device touched): head dim 256 in bfloat16 (Gemma 2's), which
    ringseq's CUDA kernel does not take, goes to torch's SDPA, and with a soft-cap, which SDPA
    cannot compute, to the reference (before: SDPA, which then raised)."""
    assert get_backend(None, "cuda", torch.bfloat16, 256).name == "sdpa"
    assert get_backend(None, "cuda", torch.bfloat16, 256, softcap=30.0).name == "reference"
    assert get_backend(None, "cuda", torch.float32, 64, spans=True, softcap=5.0).name == \
        "reference"


def test_a_named_backend_without_a_feature_names_those_that_can():
    with pytest.raises(NotImplementedError) as err:
        get_backend("sdpa", "cpu", torch.float32, 64, softcap=5.0, fn="flash_attn_func")
    can = "'ringseq' or 'reference'" if extension_available() else "'reference'"
    assert str(err.value).startswith("flash_attn_func: backend 'sdpa' cannot do logit "
                                     "soft-capping (softcap=5.0)") and \
        str(err.value).endswith(f"use backend={can}"), err.value


def test_a_backend_given_as_an_instance_is_checked_as_its_name():
    # (an instance skipped every check: sdpa then dropped the soft-cap without a word)
    from ringseq.kernels import AttentionBackend, FlashAttnBackend, SdpaBackend
    q, k, v = (torch.randn(1, 16, 2, 32) * 3 for _ in range(3))  # (b, s, h, d)
    for be in (get_backend("sdpa"), SdpaBackend()):
        with pytest.raises(NotImplementedError, match=r"^flash_attn_func: backend 'sdpa' cannot "
                                                      r"do logit soft-capping \(softcap=2.0\)"):
            ringseq.flash_attn_func(q, k, v, softcap=2.0, backend=be)

    class Plain(AttentionBackend):  # a user's backend with neither spans nor a soft-cap
        name = "plain"
    with pytest.raises(NotImplementedError, match=r"^flash_attn_func: backend 'plain' does not "
                                                  r"support spans .*; use backend="):
        ringseq.flash_attn_func(q, k, v, window_size=(2, 0), backend=Plain())
    if FlashAttnBackend().unsupported_reason(q.device, q.dtype, 32) is not None:
        with pytest.raises(ValueError, match=r"^flash_attn_func: backend 'flash_attn' cannot "
                                             r"run torch.float32 inputs with head dim 32 on cpu"):
            ringseq.flash_attn_func(q, k, v, backend=FlashAttnBackend())


# ---------------------------------------------------------------- torch.library integration
@needs_ext
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(causal, dtype):
    q, k, v = qkv(b=1, s_q=19, s_k=23, h=4, h_kv=2, d=8, dtype=dtype)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(torch.ops.ringseq.fwd.default, (q, k, v, 0.3, causal))
    out, lse = torch.ops.ringseq.fwd(q, k, v, 0.3, causal)
    dout = torch.randn_like(out)
    plain = [t.detach() for t in (dout, q, k, v, out, lse)]
    torch.library.opcheck(torch.ops.ringseq.bwd.default, (*plain, 0.3, causal))
    acc = [torch.randn(t.shape, dtype=lse.dtype) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.ringseq.bwd_accum.default, (*plain, 0.3, causal, None, *acc))
    torch.library.opcheck(torch.ops.ringseq.delta.default, (plain[0], plain[4]))


def test_the_attention_operator_names_a_key_it_cannot_read():
    """torch.ops.ringseq.attention called by hand with strings no key() made (before: "not
    enough values to unpack" and KeyError 'nonsense', naming neither operator nor argument)."""
    from ringseq.spec import attn_spec
    q, k, v = qkv(b=1, s_q=8, s_k=8, h=4, h_kv=2, d=16)
    spec = attn_spec("flash_attn_func", q, k, v, causal=True).key()
    op = torch.ops.ringseq.attention
    with pytest.raises(ValueError, match=r"^ringseq::attention: spec must be a key made by "
                                         r"AttnSpec.key\(\) .*got 'garbage'"):
        op(q, k, v, "garbage", "local", None, None)
    # a key of another operator format (a graph compiled by another ringseq, from torch's
    # cache, whose backward would unpack another list of saved tensors)
    other = spec.replace(spec.split("|")[0], "format1", 1)
    with pytest.raises(ValueError, match=r"^ringseq::attention: spec must be a key made by "
                                         r"AttnSpec.key\(\) of this ringseq \(10 fields .* the "
                                         r"first 'format\d+'\), got 'format1\|"):
        op(q, k, v, other, "local", None, None)
    for placement in ("nonsense", "ring|zigzag"):
        with pytest.raises(ValueError, match=rf"^ringseq::attention: placement must be a key "
                                             rf"made by a placement's key\(\) .*got "
                                             rf"'{re.escape(placement)}'"):
            op(q, k, v, spec, placement, None, None)
    out = op(q, k, v, spec, "local", None, None)[0]
    torch.testing.assert_close(out, ringseq.flash_attn_func(q, k, v, causal=True))


@needs_ext
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    q, k, v = qkv(s_q=24, s_k=24)

    def f(q, k, v):
        out, lse = ringseq.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.sum() + 0.5 * out.square().sum(), lse

    compiled = torch.compile(f, fullgraph=True)
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    le, lse_e = f(qe, ke, ve)
    lc, lse_c = compiled(qc, kc, vc)
    le.backward()
    lc.backward()
    assert torch.equal(lse_e, lse_c)
    torch.testing.assert_close(lc, le)
    for a, b in ((qe, qc), (ke, kc), (ve, vc)):
        torch.testing.assert_close(a.grad, b.grad)


# ---------------------------------------------------------------- property test
@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 2), s_q=st.integers(1, 70), s_k=st.integers(1, 70),
       h_kv=st.integers(1, 2), group=st.integers(1, 3), d=st.integers(1, 40),
       causal=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_property_random_shapes(b, s_q, s_k, h_kv, group, d, causal, dtype, seed):
    backend = "ringseq" if extension_available() else "reference"
    q, k, v = qkv(b, s_q, s_k, h_kv * group, h_kv, d, dtype, seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = reference_grads(q, k, v, dout, causal=causal)
    plain = reference_grads(q, k, v, dout, causal=causal, dtype=dtype)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringseq.flash_attn_func(qg, kg, vg, causal=causal, return_lse=True, backend=backend)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    for name, got, r, p, factor in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref,
                                       plain, (2, 2, 3, 3, 3)):
        assert_close_per_design(got, r, p, name, factor, scaled_floor(dtype, *ref))


# ---------------------------------------------------------------- fwd_accum: the ring's merge
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_accum_over_key_blocks_equals_one_call(backend, dtype, causal):
    """Merging key blocks one by one into a running (out, lse) gives attention over all keys.

    Causal blocks use bottom-right alignment, so block j of keys [a, b) for queries that sit at
    the end of the sequence is the causal pair (q, k[:, :b]) restricted to [a, b): here the
    blocks are disjoint key ranges of a full (non-causal) problem, plus one causal diagonal."""
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    be = get_backend(backend, "cpu", dtype, 24)
    q, k, v = qkv(b=2, s_q=50, s_k=50, h=6, h_kv=2, d=24, dtype=dtype, seed=3)
    acc = be.accum_dtype(dtype)
    out = torch.full((2, 50, 6, 24), float("nan"), dtype=acc)  # garbage where lse = -inf
    lse = torch.full((2, 6, 50), float("-inf"), dtype=acc)
    # keys [0, 20) fully visible to queries [20, 50); keys [20, 50) causal for those queries
    be.fwd_accum(q[:, 20:], k[:, :20], v[:, :20], 0.3, False, out[:, 20:], lse[:, :, 20:])
    be.fwd_accum(q[:, 20:], k[:, 20:], v[:, 20:], 0.3, causal, out[:, 20:], lse[:, :, 20:])
    be.fwd_accum(q[:, :20], k[:, :20], v[:, :20], 0.3, causal, out[:, :20], lse[:, :, :20])
    # the same keys in one call each
    if causal:
        want_o, want_l = plain_reference_split(q, k, v)
    else:
        want_o, want_l = [t.to(acc) for t in
                          ringseq.flash_attn_func(q.double(), k.double(), v.double(),
                                                  softmax_scale=0.3, causal=False,
                                                  return_lse=True, backend="reference")]
        # queries [0, 20) only saw keys [0, 20) in the non-causal run above
        o2, l2 = ringseq.flash_attn_func(q[:, :20].double(), k[:, :20].double(),
                                         v[:, :20].double(), softmax_scale=0.3, causal=False,
                                         return_lse=True, backend="reference")
        want_o[:, :20], want_l[:, :, :20] = o2.to(acc), l2.to(acc)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, want_o.to(acc), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_l.to(acc), rtol=tol, atol=tol)


def plain_reference_split(q, k, v):
    """float64 (out, lse) of the causal pattern above: queries [0, 20) see keys [0, i];
    queries [20, 50) see keys [0, 20) and, causally, keys [20, i]."""
    qd, kd, vd = q.double(), k.double(), v.double()
    h, h_kv = q.shape[2], k.shape[2]
    kd = kd.repeat_interleave(h // h_kv, 2)
    vd = vd.repeat_interleave(h // h_kv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * 0.3
    i = torch.arange(50)[:, None]
    j = torch.arange(50)[None, :]
    s = s.masked_fill(j > i, float("-inf"))  # both parts reduce to the plain causal mask
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vd), lse


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_accumulate_into_strided_views_as_into_contiguous_buffers(backend):
    """The validating calls take views of any strides ("views allowed"): a (b, h, s_q)
    statistic that is a permuted view of a (b, s_q, h) buffer and rows whose last dimension
    has stride 2 give the bits of contiguous buffers (before: the ringseq backend refused
    them with an error naming neither the function nor the view)."""
    if backend == "ringseq" and not extension_available():
        pytest.skip("ringseq._C is not built")
    be = get_backend(backend, "cpu", torch.float32, 16)
    q, k, v = qkv(b=2, s_q=20, s_k=24, h=4, h_kv=2, d=16, seed=5)

    def strided(t):  # t's values in a view whose last dimension is not unit-stride
        if t.dim() == 3:  # (b, h, s_q) as a view of (b, s_q, h)
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"))
        wide[..., ::2] = t
        return wide[..., ::2]

    out = torch.zeros(2, 20, 4, 16)  # (b, s_q, h, d) accumulators, empty: lse = -inf
    lse = torch.full((2, 4, 20), float("-inf"))  # (b, h, s_q)
    views = [strided(out), strided(lse)]
    for part in (slice(0, 10), slice(10, 24)):
        be.fwd_accum(q, k[:, part], v[:, part], 0.25, False, out, lse)
        be.fwd_accum(q, k[:, part], v[:, part], 0.25, False, *views)
    assert views[1].stride(-1) != 1 and views[0].stride(-1) == 2

    def same(got, want):  # ringseq's kernel: the same bits; torch's ops on strided views
        # may round elementwise steps differently (a few float32 ulps)
        if backend == "ringseq":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=4 * 2 ** -23, atol=4 * 2 ** -23)

    same(views[0], out)
    same(views[1], lse)
    dout = torch.randn_like(q)  # (b, s_q, h, d)
    want = be.bwd(dout, q, k, v, out, lse, 0.25, False)
    got = be.bwd(dout, q, k, v, out, strided(lse), 0.25, False)
    accs = [strided(torch.zeros_like(t)) for t in (q, k, v)]
    be.bwd_accum(dout, q, k, v, out, strided(lse), 0.25, False, None, *accs)
    for w, g, a in zip(want, got, accs):
        same(g, w)
        same(a, w)


@needs_ext
def test_the_raw_operators_name_themselves_and_refuse_what_float32_cannot_hold():
    """Direct calls of torch.ops.ringseq.*: errors name the operator (before: "unsupported
    dtype Int" from delta, "lse must be Float ..." from bwd); a scale or cap beyond float32's
    range is refused for 16/32-bit inputs as the Python layer refuses it (before: NaN outputs,
    or capping silently off); tile_config outside 0..2 (before: accepted on CPU, truncated to
    int on CUDA); a bad delta with empty inputs (before: accepted)."""
    q, k, v = qkv(b=1, s_q=3, s_k=3, h=2, h_kv=2, d=8)
    ops = torch.ops.ringseq
    with pytest.raises(ValueError, match=r"^ringseq::delta: out must be float32, float64, "
                                         r"bfloat16 or float16, got Int"):
        ops.delta(torch.zeros(1, 3, 2, 8, dtype=torch.int32), torch.zeros(1, 3, 2, 8,
                                                                           dtype=torch.int32))
    out, lse = ops.fwd(q, k, v, 0.5, False)
    with pytest.raises(ValueError, match=r"^ringseq::bwd: lse must be Float for Float inputs"):
        ops.bwd(out, q, k, v, out, lse.double(), 0.5, False)
    for bad in (dict(softcap=1e39), dict(softcap=1e-46), dict(softmax_scale=-1e39)):
        scale = bad.get("softmax_scale", 0.5)
        with pytest.raises(ValueError, match=r"^ringseq::fwd: .* within float32's range"):
            ops.fwd(q, k, v, scale, False, 0, None, bad.get("softcap", 0.0))
    # float64 inputs scale and cap in float64: no float32 limit there
    o64, _ = ops.fwd(q.double(), k.double(), v.double(), 0.5, False, 0, None, 1e39)
    assert torch.isfinite(o64).all()
    for tile_config in (-1, 3, 2 ** 32 + 1):
        with pytest.raises(ValueError, match=r"^ringseq::fwd: tile_config must be 0 "):
            ops.fwd(q, k, v, 0.5, False, tile_config)
    with pytest.raises(ValueError, match=r"^ExtensionBackend: tile_config must be"):
        ringseq.kernels.extension.ExtensionBackend(99)
    # the operator's own delta of an empty batch is taken (its empty transposed strides)
    none = q[:0]  # (0, 3, 2, 8)
    n_out, n_lse = ops.fwd(none, none, none, 0.5, True)
    grads = ops.bwd(n_out, none, none, none, n_out, n_lse, 0.5, True, ops.delta(n_out, n_out))
    assert [tuple(g.shape) for g in grads] == [(0, 3, 2, 8)] * 3
    empty = q[:, :0]  # (1, 0, 2, 8)
    e_out, e_lse = ops.fwd(empty, k, v, 0.5, False)
    with pytest.raises(ValueError, match=r"^ringseq::bwd: delta must have shape"):
        ops.bwd(e_out, empty, k, v, e_out, e_lse, 0.5, False, torch.zeros(7, 7,
                                                                         dtype=torch.int64))


@needs_ext
def test_fwd_accum_keeps_rows_whose_block_sees_nothing():
    """A causal block with s_q > s_k leaves its first rows untouched (they see no key)."""
    q, k, v = qkv(b=1, s_q=30, s_k=10, h=2, h_kv=2, d=8)
    out0 = torch.randn(1, 30, 2, 8)
    lse0 = torch.randn(1, 2, 30)
    out, lse = out0.clone(), lse0.clone()
    torch.ops.ringseq.fwd_accum(q, k, v, 0.5, True, out, lse)
    assert torch.equal(out[:, :20], out0[:, :20]) and torch.equal(lse[:, :, :20], lse0[:, :, :20])
    assert not torch.equal(out[:, 20:], out0[:, 20:])


@needs_ext
def test_opcheck_fwd_accum():
    q, k, v = qkv(b=1, s_q=19, s_k=23, h=4, h_kv=2, d=8)
    out = torch.randn(1, 19, 4, 8)
    lse = torch.randn(1, 4, 19)
    torch.library.opcheck(torch.ops.ringseq.fwd_accum.default, (q, k, v, 0.3, True, out, lse))


def test_flash_attn_backend_gives_empty_rows_lse_minus_inf(monkeypatch):
    """flash-attn 2 returns lse +inf for a row that sees no key (causal, more queries than
    keys); the backend contract, which the ring's merge relies on, is -inf. flash-attn is not
    installed here: a stand-in with its return convention."""
    import sys
    import types
    from ringseq.kernels.flash_attn import FlashAttnBackend

    def flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, return_attn_probs):
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # (b, h, s_q)
        lse[:, :, 0] = float("inf")  # row 0 sees no key
        return torch.zeros_like(q), lse, None
    monkeypatch.setitem(sys.modules, "flash_attn",
                        types.SimpleNamespace(flash_attn_func=flash_attn_func))
    q = torch.zeros(1, 3, 2, 8)
    _, lse = FlashAttnBackend()._fwd(q, q[:, :2], q[:, :2], 0.3, True)
    assert torch.isneginf(lse[:, :, 0]).all() and (lse[:, :, 1:] == 0).all(), lse


@pytest.mark.parametrize("backend", ["sdpa", "reference"] + (["ringseq"] if extension_available()
                                                              else []))
def test_a_query_whose_every_score_is_minus_inf_gives_out_0_and_lse_minus_inf(backend):
    """As the README says, for every backend: a -inf in a query (keys positive there) makes
    every score of its row -inf: out 0, lse -inf (+inf under return_attn_probs), alone and
    over a ring of 4 (before: 'sdpa' gave lse 0, and log 4 after the ring's merge). The
    other rows keep the float64 reference's values."""
    import math
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.float64) for _ in range(3))  # (b, s, h, d)
    k[..., 0] = k[..., 0].abs() + 0.1
    q[0, 2, 1, 0] = -math.inf  # (row 2 of head 1)
    seen = torch.ones(1, 2, 8, dtype=torch.bool)  # (b, h, s)
    seen[0, 1, 2] = False
    want_out, want_lse = ringseq.flash_attn_func(q, k, v, return_lse=True, backend="reference")
    for out, lse in (ringseq.flash_attn_func(q, k, v, return_lse=True, backend=backend),
                     ringseq.simulate_ring(q, k, v, world_size=4, backend=backend)):
        assert (out[0, 2, 1] == 0).all() and torch.isneginf(lse[0, 1, 2]), (out[0, 2], lse)
        assert torch.allclose(lse[seen], want_lse[seen], atol=1e-12)
        assert torch.allclose(out.transpose(1, 2)[seen], want_out.transpose(1, 2)[seen],
                              atol=1e-12)
    _, lse, _ = ringseq.flash_attn_func(q, k, v, return_attn_probs=True, backend=backend)
    assert torch.isposinf(lse[0, 1, 2]), lse
    # fp16 rows whose products exceed fp16's range before the scale are ordinary rows, also
    # beside a -inf in another batch row (a review's repro: a first version zeroed them)
    q, k = torch.full((2, 8, 1, 64), -40.0).half(), (torch.rand(2, 8, 1, 64) * 2 + 40).half()
    v = torch.randn(2, 8, 1, 64).half()
    q[1, 3, 0, 0] = -math.inf
    out, lse = ringseq.flash_attn_func(q, k, v, return_lse=True, backend=backend)
    want_out, want_lse = ringseq.flash_attn_func(q.double(), k.double(), v.double(),
                                                 return_lse=True, backend="reference")
    assert torch.isfinite(lse[0]).all() and (lse[0] - want_lse[0]).abs().max() < 1, lse
    assert (out[0].double() - want_out[0]).abs().max() < 1e-2


def test_forward_mode_ad_and_torch_func_transforms_are_refused():
    """The operator's derivative is its backward: forward-mode AD (torch.func.jvp, dual
    tensors) raises instead of giving a zero tangent without a word (before: jvp's tangent was
    0 where the finite difference is about 1.7), and torch.func's other transforms raise an
    error naming ringseq; reverse mode still works."""
    import torch.autograd.forward_ad as fwAD
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))

    def f(x):
        return ringseq.flash_attn_func(x, k, v, causal=True)
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jvp(f, (q,), (torch.ones_like(q),))
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        f(fwAD.make_dual(q, torch.ones_like(q)))
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(f)(q[None])
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda x: f(x).sum())(q)
    x = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(f(x).sum(), x)
    assert torch.isfinite(dq).all() and dq.abs().max() > 0
    # functionalize computes no derivative: it runs
    assert torch.equal(torch.func.functionalize(f)(q), f(q))


def test_torch_func_transforms_are_refused_inside_torch_compile():
    """A compiled torch.func.jvp (before: a zero tangent where the float64 finite difference
    is 2.5, with no error) and a compiled torch.func.grad raise naming the function; the
    compiled forward and backward are unchanged."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))

    def f(x):
        return ringseq.flash_attn_func(x, k, v, causal=True)
    for transform in (lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),)),
                      lambda x: torch.func.grad(lambda y: f(y).sum())(x)):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"flash_attn_func: torch.func transforms \((jvp|grad) "
                                            r"here"):
            torch.compile(transform, fullgraph=True)(q)
    torch._dynamo.reset()
    x = q.clone().requires_grad_()
    out = torch.compile(f, fullgraph=True)(x)
    out.sum().backward()
    x2 = q.clone().requires_grad_()
    f(x2).sum().backward()
    assert torch.equal(out, f(q)) and torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("backend", ["ringseq", "sdpa", "reference"])
def test_backend_calls_refuse_row_tensors_of_other_shapes(backend):
    """A backend's validating calls check dout, out, lse, delta and the accumulators against q
    and v (before: sdpa's bwd read past a shorter dout or lse and returned garbage, NaN in one
    run, |dk| 43 against 1.8 in another)."""
    from ringseq.kernels import get_backend
    be = get_backend(backend)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 8, generator=g)   # (b, s_q, h, d)
    k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(2))  # (b, s_k, h_kv, d)
    out, lse = be.fwd(q, k, v, 0.3, False)
    dout = torch.randn_like(out)
    for name, args in (("dout", (dout[:, :3], q, k, v, out, lse)),
                       ("out", (dout, q, k, v, out[:, :, :2], lse)),
                       ("lse", (dout, q, k, v, out, lse[..., :3]))):
        with pytest.raises(ValueError, match=rf"^{backend}\.bwd: {name} must have shape"):
            be.bwd(*args, 0.3, False)
    acc = [torch.zeros(t.shape) for t in (q, k, v)]
    with pytest.raises(ValueError, match=rf"^{backend}\.bwd_accum: dk_accum must have shape"):
        be.bwd_accum(dout, q, k, v, out, lse, 0.3, False, None, acc[0], acc[0], acc[2])
    with pytest.raises(ValueError, match=rf"^{backend}\.fwd_accum: lse_acc must have shape"):
        be.fwd_accum(q, k, v, 0.3, False, torch.zeros(out.shape), lse[:, :1].clone())
    dq, dk, dv = be.bwd(dout, q, k, v, out, lse, 0.3, False)  # the right shapes still run
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_scale_and_softcap_beyond_float32_are_refused():
    """The kernels scale and cap in float32 for 16- and 32-bit inputs: values beyond its range
    gave all-NaN outputs (softcap or scale 1e39) or no capping at all (softcap 1e-50, 2.42 off
    float64); refused, naming the argument."""
    q = torch.randn(1, 8, 2, 16)
    for kw, needle in ((dict(softcap=1e39), "softcap must be 0.0 .off. or within float32"),
                       (dict(softcap=1e-50), "softcap must be 0.0 .off. or within float32"),
                       (dict(softmax_scale=1e39), "softmax_scale must be within float32"),
                       (dict(softmax_scale=-1e300), "softmax_scale must be within float32")):
        with pytest.raises(ValueError, match="^flash_attn_func: " + needle):
            ringseq.flash_attn_func(q, q, q, **kw)
    out = ringseq.flash_attn_func(q, q, q, softcap=3e38, softmax_scale=1e-30)  # in range: runs
    assert torch.isfinite(out).all()


def test_zero_heads_and_a_group_that_is_not_one_are_named():
    """K/V without heads are said to need one (before: "must be divisible", 0 by 0); queries
    without heads next to K/V heads are an empty call, like batch 0; a group that is not a
    process group is a TypeError (before: a message about not being a member of it)."""
    q = torch.randn(2, 4, 0, 8)
    with pytest.raises(ValueError, match="k and v need at least one head"):
        ringseq.flash_attn_func(q, q, q)
    kv = torch.randn(2, 4, 2, 8)
    assert ringseq.flash_attn_func(q, kv, kv).shape == (2, 4, 0, 8)
    q = torch.randn(1, 8, 2, 16)
    for group in ("world", [0, 1]):
        with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup "
                                            r"or None .* got " + repr(group).replace("[", r"\[")):
            ringseq.ring_flash_attn_func(q, q, q, group=group)
    # the ring accessors name themselves (before: get_ring's message named no function)
    for name in ("get_ring", "get_comm", "reset_ring"):
        with pytest.raises(TypeError, match=rf"^{name}: group must be a torch.distributed "
                                            rf"ProcessGroup or None .* got 'x' \(str\)"):
            getattr(ringseq, name)("x")


def test_a_backend_refusing_the_lse_gradient_names_the_function():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    out, lse = ringseq.flash_attn_func(q, q, q, return_lse=True, backend="sdpa")
    with pytest.raises(RuntimeError, match=r"^flash_attn_func: backend 'sdpa' cannot "
                                           r"backpropagate through lse"):
        (out.sum() + lse.sum()).backward()


def test_a_compiled_sdpa_call_returning_lse_backpropagates_its_output_alone():
    """Compiled, the backward gets zeros for an lse no loss reached (eager: None): taken as no
    gradient (before: refused as if the lse reached the loss); one that does is refused."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 16, generator=g)

    def attn(x):
        return ringseq.flash_attn_func(x, x, x, return_lse=True, backend="sdpa")
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (attn, compiled):
        x = q.clone().requires_grad_()
        fn(x)[0].sum().backward()
        grads.append(x.grad)
    assert torch.equal(*grads)
    x = q.clone().requires_grad_()
    out, lse = compiled(x)
    with pytest.raises(RuntimeError, match=r"^flash_attn_func: backend 'sdpa' cannot "
                                           r"backpropagate through lse"):
        (out.sum() + lse.sum()).backward()


def test_a_backend_or_layout_made_inside_a_compiled_function_is_refused():
    """The operator looks it up at run time by a key registered at trace time, for dynamo's
    copy of it, whose attributes the compiled code never sets (before: a backend's class
    defaults used silently, 1.06 off here, or AttributeError at run time)."""
    from ringseq.kernels.reference import ReferenceBackend

    class Scaled(ReferenceBackend):
        name = "scaled_test"
        temperature = 1.0

        def __init__(self, temperature):
            super().__init__()
            self.temperature = temperature

        def _fwd(self, q, k, v, scale, causal, spans=None, softcap=0.0):
            return super()._fwd(q, k, v, scale * self.temperature, causal, spans=spans,
                                softcap=softcap)
    q = torch.randn(1, 6, 2, 8)
    made = Scaled(4.0)
    calls = {"inside": lambda x: ringseq.flash_attn_func(x, x, x, backend=Scaled(4.0)),
             "outside": lambda x: ringseq.flash_attn_func(x, x, x, backend=made)}
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"ringseq: the attention backend Scaled is made, and its "
                                        r"attributes set, inside the function torch.compile"):
        torch.compile(calls["inside"], fullgraph=True, backend="aot_eager")(q)
    got = torch.compile(calls["outside"], fullgraph=True, backend="aot_eager")(q)
    assert torch.equal(got, calls["outside"](q))
    # one without attributes of its own is the same object either way (a first version of the
    # refusal refused it)
    def stateless(x):
        return ringseq.flash_attn_func(x, x, x, backend=ReferenceBackend())
    got = torch.compile(stateless, fullgraph=True, backend="aot_eager")(q)
    assert torch.equal(got, stateless(q))


def test_a_window_of_tensors_under_fullgraph_names_the_way_out():
    """(before: "Failed to trace builtin operator `str`", naming neither)"""
    q = torch.randn(1, 6, 2, 8)

    def attn(left):
        return ringseq.flash_attn_func(q, q, q, causal=True, window_size=(left, 0))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"ringseq reads a window_size given as tensors on the "
                                        r"host, which a graph cannot: under "
                                        r"torch.compile\(fullgraph=True\) pass ints"):
        torch.compile(attn, fullgraph=True, backend="aot_eager")(torch.tensor(2))
    got = torch.compile(attn, backend="aot_eager")(torch.tensor(2))  # (a graph break)
    assert torch.equal(got, attn(2))


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_window_that_changes_between_compiled_calls(dynamic):
    """An int argument that takes a second value becomes symbolic under torch.compile (at once
    with dynamic=True): the window is specialized per value (before: fullgraph raised
    "Failed to trace builtin operator 'str'" from the second value on, or at the first call
    with dynamic=True)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))

    def attn(left):
        return ringseq.flash_attn_func(q, k, v, causal=True, window_size=(left, 0))
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, dynamic=dynamic)
    for left in (3, 5, 7):
        assert torch.equal(compiled(left), attn(left)), left


def test_a_transform_over_something_else_runs_attention_as_a_constant():
    """torch.func.grad / vmap / jvp over a scalar that scales attention's output, its inputs
    constants to the transform: attention runs below it (before the operator's refusal at
    functorch's dispatch key looked at the inputs, these raised)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=g) for _ in range(3))
    w = torch.tensor(2.0, dtype=torch.float64)
    total = ringseq.flash_attn_func(q, k, v, causal=True).sum()

    def f(w):
        return (w * ringseq.flash_attn_func(q, k, v, causal=True)).sum()
    # (float64; the sums of w * out and of out differ in rounding only)
    def close(a, b):
        return torch.allclose(a, b, rtol=1e-12, atol=0)
    assert close(torch.func.grad(f)(w), total)
    assert close(torch.func.vmap(f)(torch.stack([w, 3 * w])), torch.stack([2 * total, 6 * total]))
    assert close(torch.func.jvp(f, (w,), (torch.ones_like(w),))[1], total)


@pytest.mark.parametrize("call, needle", [
    (lambda q, k: torch.ops.ringseq.fwd(q.int(), k.int(), k.int(), 0.3, True),
     r"^ringseq::fwd: q, k, v must be float16, bfloat16, float32 or float64, got torch.int32"),
    (lambda q, k: torch.ops.ringseq.fwd(q, k, k, 0.3, True, 5),
     r"^ringseq::fwd: tile_config must be 0, 1 or 2, got 5"),
    (lambda q, k: torch.ops.ringseq.fwd_accum(q, k, k, 0.3, True, q.double(),
                                              torch.empty(1, 2, 4, dtype=torch.float64)),
     r"^ringseq::fwd_accum: out_acc and lse_acc must be torch.float32 for torch.float32"),
    (lambda q, k: torch.ops.ringseq.fwd(q, q[:, :, :1].expand(1, 4, 3, 8),
                                        q[:, :, :1].expand(1, 4, 3, 8), 0.3, True),
     r"^ringseq::fwd: nheads must be divisible by nheads_kv, got 2 and 3"),
])
def test_fake_implementations_refuse_what_the_kernels_refuse(call, needle):
    """Under FakeTensorMode (what torch.compile traces with): before, int inputs, tile_config 5
    and float64 accumulators for float32 inputs were accepted, and errors named no operator."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(1, 4, 2, 8), torch.empty(1, 4, 1, 8)
        with pytest.raises(RuntimeError, match=needle):
            call(q, k)


def test_available_backends_lists_what_runs_and_names_bad_arguments():
    from ringseq.kernels import BACKEND_NAMES, available_backends
    q = torch.randn(1, 8, 2, 16)
    names = available_backends("cpu", torch.float32, 16)
    assert names and set(names) <= set(BACKEND_NAMES) and "reference" in names
    for name in names:  # each one listed runs such inputs
        ringseq.flash_attn_func(q, q, q, causal=True, backend=name)
    assert available_backends(torch.device("cpu"), torch.float64, 16) == \
        available_backends("cpu", torch.float64, 16)
    # (before: ints and a head dim of 0 were listed as runnable by every backend, and a bad
    # device name raised torch's bare error)
    for args, kind, words in (
            (("cpu", torch.int64, 64), ValueError, "dtype must be one of"),
            (("cpu", torch.float32, 0), ValueError, "headdim must be >= 1, got 0"),
            (("cpu", "float32", 64), TypeError, "dtype must be a torch.dtype, got 'float32'"),
            (("cpu", torch.float32, 64.0), TypeError, "headdim must be an int"),
            (("gpu0",), ValueError, "device 'gpu0' is not a device torch knows"),
            ((3,), TypeError, "device must be a torch.device or its name")):
        with pytest.raises(kind, match="^available_backends: " + words):
            available_backends(*args)


@pytest.mark.skipif(not extension_available(), reason="ringseq._C is not built")
def test_a_forced_cpu_level_that_cannot_run_is_named_by_the_call_and_not_listed(monkeypatch):
    """RINGSEQ_CPU_ISA naming no level, or a level this CPU lacks (where one is built): the
    backend lists leave 'ringseq' out, and a call that would run it raises RuntimeError naming
    the function called and the level (before: listed as available, and the kernel's error
    named no function); backend='reference' still runs. flash_attn_with_kvcache raises it too,
    before it appends the new keys (before: the kernel's message, after writing them)."""
    from ringseq.kernels import available_backends
    from ringseq.kernels.extension import _C
    lacking = [lv for lv in _C.cpu_isa_built() if lv not in _C.cpu_isa_supported()]
    q = torch.randn(1, 8, 2, 16)  # (b, s, h, d)
    try:
        for level in ["sse9", *lacking]:
            monkeypatch.setenv("RINGSEQ_CPU_ISA", level)
            _C._set_cpu_isa(None)  # (the next call reads the variable)
            assert "ringseq" not in available_backends("cpu", torch.float32, 16), level
            for backend in (None, "ringseq"):
                with pytest.raises(RuntimeError, match=rf"^flash_attn_func: RINGSEQ_CPU_ISA"
                                                       rf".*{level}"):
                    ringseq.flash_attn_func(q, q, q, backend=backend)
            with pytest.raises(RuntimeError, match=rf"^get_backend: RINGSEQ_CPU_ISA.*{level}"):
                get_backend(device="cpu")
            get_backend("ringseq")  # (a name checked before any input, as apply does)
            out = ringseq.flash_attn_func(q, q, q, causal=True, backend="reference")
            assert torch.isfinite(out).all()
            cache = torch.zeros(1, 16, 2, 16)  # (b, capacity, h_kv, d)
            with pytest.raises(RuntimeError, match=rf"^flash_attn_with_kvcache: "
                                                   rf"RINGSEQ_CPU_ISA.*{level}"):
                ringseq.flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), k=q[:, :1],
                                                v=q[:, :1], cache_seqlens=3)
            assert not cache.any()  # nothing appended
    finally:
        monkeypatch.delenv("RINGSEQ_CPU_ISA")
        _C._set_cpu_isa(None)


def _dtensor_inputs():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from utils import error_text
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = (torch.randn(1, 8, 4, 8) for _ in range(3))  # (b, s_local, h, d)
    as_dt = [DTensor.from_local(t, mesh, [Replicate()]) for t in (q, k, v)]
    return {"q_only": error_text(lambda: ringseq.ring_flash_attn_func(as_dt[0], k, v, causal=True)),
            "sdpa_all": error_text(lambda: ringseq.ring_sdpa(*(t.transpose(1, 2) for t in as_dt))),
            "kvcache": error_text(lambda: ringseq.flash_attn_with_kvcache(as_dt[0], k, v)),
            "ring_kvcache": error_text(lambda: ringseq.ring_flash_attn_with_kvcache(
                q[:, :1], as_dt[1], v, 4, prefill_len=0)),
            "plain_after": tuple(ringseq.ring_flash_attn_func(q, k, v, causal=True).shape)}


def test_dtensor_inputs_are_refused_by_name_on_every_rank():
    """(Before: DTensor's "Operator ringseq.attention.default does not have a sharding strategy
    registered", or for q alone its advice to make every input a DTensor.)"""
    from dist_utils import run_ranks
    for r in run_ranks(_dtensor_inputs, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        assert r["q_only"] == (
            "TypeError: ring_flash_attn_func: q, k and v must be this rank's local tensors, got "
            "q as DTensor: pass .to_local() of each (a tensor-parallel projection with "
            "use_local_output=True gives them)"), r
        assert r["sdpa_all"].startswith("TypeError: ring_sdpa: query, key and value must be this "
                                        "rank's local tensors, got query, key, value as DTensor"), r
        assert r["kvcache"] == (
            "TypeError: flash_attn_with_kvcache: q, k_cache, v_cache, k and v must be this "
            "rank's local tensors, got q as DTensor: pass .to_local() of each (a "
            "tensor-parallel projection with use_local_output=True gives them)"), r
        assert r["ring_kvcache"].startswith(
            "TypeError: ring_flash_attn_with_kvcache: q, k_cache_shard, v_cache_shard, k and v "
            "must be this rank's local tensors, got k_cache_shard as DTensor"), r
        assert r["plain_after"] == (1, 8, 4, 8)


def _forward_only_backend():
    from ringseq.kernels import ReferenceBackend

    from utils import error_text

    class ForwardOnly(ReferenceBackend):  # (as flash-attn's: no block gradients from merged out)
        name = "forward_only_test"
        supports_global_backward = False

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 16) for _ in range(3))  # (b, s_local, h, d)
    with torch.no_grad():
        ours = ringseq.ring_flash_attn_func(q, k, v, causal=True, backend=ForwardOnly())
        ref = ringseq.ring_flash_attn_func(q, k, v, causal=True, backend="reference")
    q.requires_grad_(True)
    return {"no_grad_equal": torch.equal(ours, ref),
            "training": error_text(lambda: ringseq.ring_flash_attn_func(
                q, k, v, causal=True, backend=ForwardOnly()))}


def test_a_backend_without_block_gradients_runs_ring_inference_and_is_refused_for_training():
    """(Before: refused under no_grad too, against kernels/flash_attn.py's "the ring refuses it
    for training".)"""
    from dist_utils import run_ranks
    for r in run_ranks(_forward_only_backend, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        assert r["no_grad_equal"], r
        assert r["training"].startswith(
            "ValueError: ring_flash_attn_func: backend 'forward_only_test' cannot compute a "
            "block's gradients from the merged output of a ring"), r


def test_a_value_of_another_kind_is_named_briefly():
    """An error shows an array by its type and shape and cuts any other value's repr (before:
    a (1, 512, 8, 64) nested list given for q put 5 million characters into the message)."""
    import numpy as np
    k = torch.randn(1, 4, 2, 8)  # (b, s, h_kv, d)
    nested = torch.zeros(1, 512, 8, 64).tolist()
    with pytest.raises(TypeError) as info:
        ringseq.flash_attn_func(nested, k, k)
    text = str(info.value)
    assert text.startswith("flash_attn_func: q must be a 4-dim tensor") and len(text) < 400, \
        text[:500]
    assert text.endswith("characters) (list)"), text
    with pytest.raises(TypeError, match=r"got a numpy.ndarray of shape \(1, 512, 8, 64\)$"):
        ringseq.flash_attn_func(np.zeros((1, 512, 8, 64)), k, k)
    with pytest.raises(TypeError, match=r"got 3 \(int\)$"):
        ringseq.flash_attn_func(3, k, k)
