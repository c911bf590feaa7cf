"""Drop-in compatibility with flash-attn 2 and ring-flash-attention (issue 17).

- The parameter lists of ringseq's functions match the reference signatures, written below
  from flash-attn's and ring-flash-attention's documentation (neither package is imported).
- Every positional and keyword form of those signatures computes attention that passes
  docs/design.md's rule against float64 (out/lse 2x, gradients 3x the error of plain float32
  attention): flash-attn's functions on one device, the ring functions at W=1 (in process) and
  W=2, 4 (one spawn per world size for all cases), on inputs sharded the way
  ring-flash-attention's documentation describes (not with ``ringseq.shard``).
- Every unsupported or mistaken value raises an error naming the parameter.
"""
from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch
import torch.distributed as dist

import ringseq

from dist_utils import RankError, run_ranks
from utils import assert_close_per_design, default_floor, reference_grads

# ------------------------------------------------------------ reference signatures
# flash-attn 2 (flash_attn/flash_attn_interface.py docstrings, v2.6+).
_FA2_TAIL = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
             "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False")
FLASH_ATTN_2 = {
    "flash_attn_func": "q, k, v, " + _FA2_TAIL,
    "flash_attn_kvpacked_func": "q, kv, " + _FA2_TAIL,
    "flash_attn_qkvpacked_func": "qkv, " + _FA2_TAIL,
}
# ring-flash-attention (README: every function has *_func, *_kvpacked_func, *_qkvpacked_func).
_RFA_TAIL = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
             "alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None")
RING_FLASH_ATTN = {
    f"{prefix}_{suffix}": f"{tensors}, {_RFA_TAIL}"
    for prefix in ("ring_flash_attn", "zigzag_ring_flash_attn", "stripe_flash_attn")
    for suffix, tensors in (("func", "q, k, v"), ("kvpacked_func", "q, kv"),
                            ("qkvpacked_func", "qkv"))
}
REFERENCE = {**FLASH_ATTN_2, **RING_FLASH_ATTN}
LAYOUT_OF = {"ring_flash_attn": "contiguous", "zigzag_ring_flash_attn": "zigzag",
             "stripe_flash_attn": "stripe"}
# ringseq's keyword-only extras
EXTRAS = {name: ({"return_lse", "backend"} if name in FLASH_ATTN_2 else
                 {"layout", "return_lse", "backend", "grad_comm_dtype", "softcap"}
                 | ({"cu_seqlens"} if name == "ring_flash_attn_func" else set())
                 if name.startswith("ring_flash_attn") else
                 {"return_lse", "backend", "grad_comm_dtype", "softcap"})
          for name in REFERENCE}


def _parse(params: str):
    """[(name, default or inspect.Parameter.empty)] of a documented parameter list."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    defaults = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults]
    return [(a.arg, d) for a, d in zip(args.args, defaults)]


@pytest.mark.parametrize("name", list(REFERENCE))
def test_signature_matches_reference(name):
    sig = inspect.signature(getattr(ringseq, name))
    params = list(sig.parameters.values())
    positional = [(p.name, p.default) for p in params
                  if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == _parse(REFERENCE[name]), f"{name}{sig}"
    others = params[len(positional):]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in others), f"{name}{sig}"
    assert {p.name for p in others} == EXTRAS[name], f"{name}{sig}"
    assert name in ringseq.__all__


# ------------------------------------------------------------ call forms
# Each form calls a function with the tensors and its documented parameters, and says what
# the call means: (softmax_scale, causal, returns lse). A form uses only documented names.
def _forms(name):
    ring = name in RING_FLASH_ATTN
    tail = {"dropout_p": 0.0, "window_size": (-1, -1), "alibi_slopes": None,
            "deterministic": True, "return_attn_probs": True}
    if not ring:
        tail["softcap"] = 0.0
    else:
        tail["group"] = None
    order = [p for p, _ in _parse(REFERENCE[name]) if p in tail or p in ("softmax_scale",
                                                                           "causal")]

    def positional(scale, causal):
        vals = dict(tail, softmax_scale=scale, causal=causal)
        return lambda f, t: f(*t, *[vals[p] for p in order])

    def keyword(scale, causal):
        vals = dict(tail, softmax_scale=scale, causal=causal)
        return lambda f, t: f(*t, **{p: vals[p] for p in reversed(order)})  # any order

    return [
        ("all positional", positional(0.3, False), 0.3, False, True),
        ("all keyword", keyword(0.25, True), 0.25, True, True),
        ("defaults", lambda f, t: f(*t), None, False, False),
        ("flash-attn causal positional (q, k, v, 0.0, None, True)",
         lambda f, t: f(*t, 0.0, None, True), None, True, False),
        ("keywords, some", lambda f, t: f(*t, causal=True, softmax_scale=0.2), 0.2, True,
         False),
    ]


def _pack(name, q, k, v):
    """The leaf tensors a function takes, and how to read (dq, dk, dv) from their grads."""
    if "qkvpacked" in name:
        qkv = torch.stack([q, k, v], dim=2).requires_grad_()
        return (qkv,), lambda: (qkv.grad[:, :, 0], qkv.grad[:, :, 1], qkv.grad[:, :, 2])
    if "kvpacked" in name:
        q1, kv = q.clone().requires_grad_(), torch.stack([k, v], dim=2).requires_grad_()
        return (q1, kv), lambda: (q1.grad, kv.grad[:, :, 0], kv.grad[:, :, 1])
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    return (q1, k1, v1), lambda: (q1.grad, k1.grad, v1.grad)


def _call(name, form, q, k, v, dout):
    """Runs one form; returns {"out", "lse" (or None), "dq", "dk", "dv", "kind"}."""
    _, call, _, _, with_lse = form
    tensors, grads = _pack(name, q, k, v)
    res = call(getattr(ringseq, name), tensors)
    if with_lse:
        assert isinstance(res, tuple) and len(res) == 3 and res[2] is None, type(res)
        out, lse = res[0], res[1]
    else:
        assert isinstance(res, torch.Tensor), type(res)
        out, lse = res, None
    out.backward(dout)
    dq, dk, dv = grads()
    return {"out": out.detach(), "lse": None if lse is None else lse.detach(), "dq": dq,
            "dk": dk, "dv": dv}


def _check(name, form, got, ref, plain, floor=1e-6):
    """ref/plain: (out, lse, dq, dk, dv) (already this rank's part)."""
    label, _, _, _, with_lse = form
    assert (got["lse"] is not None) == with_lse
    for j, key in enumerate(("out", "lse", "dq", "dk", "dv")):
        if got[key] is None:
            continue
        if key == "lse":
            assert got[key].dtype == torch.float32
        assert_close_per_design(got[key], ref[j], plain[j], name=f"{name} [{label}] {key}",
                                factor=2.0 if j < 2 else 3.0, floor=floor)


def _inputs(seed, b, s_q, s_k, h, h_kv, d=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s_q, h, d, generator=g), torch.randn(b, s_k, h_kv, d, generator=g),
            torch.randn(b, s_k, h_kv, d, generator=g), torch.randn(b, s_q, h, d, generator=g))


def _refs(q, k, v, dout, scale, causal):
    return (reference_grads(q, k, v, dout, scale, causal),
            reference_grads(q, k, v, dout, scale, causal, dtype=torch.float32))


# ------------------------------------------------------------ flash-attn, one device
@pytest.mark.parametrize("name", list(FLASH_ATTN_2))
def test_flash_attn_forms_match_float64(name):
    # s_q != s_k (bottom-right causal) and GQA where the form allows it
    shape = (2, 37, 37, 3, 3) if "qkvpacked" in name else (2, 37, 45, 4, 2)
    q, k, v, dout = _inputs(1, *shape)
    for form in _forms(name):
        got = _call(name, form, q, k, v, dout)
        ref, plain = _refs(q, k, v, dout, form[2], form[3])
        _check(name, form, got, ref, plain)


# ------------------------------------------------------------ ring functions, W = 1, 2, 4
def _rfa_shard(x, layout, w, r):
    """This rank's tokens as ring-flash-attention's documentation lays them out."""
    if layout == "contiguous":
        return x.chunk(w, dim=1)[r]
    if layout == "zigzag":  # chunks r and 2W-1-r of 2W
        c = x.chunk(2 * w, dim=1)
        return torch.cat([c[r], c[2 * w - 1 - r]], dim=1)
    return x[:, r::w]  # stripe: token t on rank t mod W


def _layout(name):
    prefix = name.rsplit("_", 2)[0] if "packed" in name else name[:-len("_func")]
    return LAYOUT_OF[prefix]


def _ring_shapes(name, w):
    s = 10 * w  # zigzag: chunks of 5
    return (1, s, s, 3, 3) if "qkvpacked" in name else (2, s, s, 4, 2)


def _ring_worker(names):
    w = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if dist.is_initialized() else 0
    results = {}
    for name in names:
        layout = _layout(name)
        full = _inputs(7, *_ring_shapes(name, w))
        q, k, v, dout = (_rfa_shard(t, layout, w, r).contiguous() for t in full)
        results[name] = [_call(name, form, q, k, v, dout) for form in _forms(name)]
    return results


_RING: dict = {}


def _ring_results(w):
    if w not in _RING:
        names = list(RING_FLASH_ATTN)
        if w == 1:
            assert not dist.is_initialized()
            _RING[w] = [_ring_worker(names)]
        else:
            try:
                _RING[w] = run_ranks(_ring_worker, w, names, timeout=180)
            except RankError as exc:
                _RING[w] = exc
    if isinstance(_RING[w], Exception):
        raise _RING[w]
    return _RING[w]


@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("name", list(RING_FLASH_ATTN))
def test_ring_forms_match_float64(name, w):
    per_rank = _ring_results(w)
    layout = _layout(name)
    q, k, v, dout = _inputs(7, *_ring_shapes(name, w))
    for i, form in enumerate(_forms(name)):
        ref, plain = _refs(q, k, v, dout, form[2], form[3])
        for r in range(w):
            # lse is (b, h, s): its sequence dim is 2
            part = [_rfa_shard(t.transpose(1, 2), layout, w, r).transpose(1, 2) if j == 1
                    else _rfa_shard(t, layout, w, r) for j, t in enumerate(ref)]
            plain_part = [_rfa_shard(t.transpose(1, 2), layout, w, r).transpose(1, 2)
                          if j == 1 else _rfa_shard(t, layout, w, r)
                          for j, t in enumerate(plain)]
            _check(f"{name} W={w} rank {r}", form, per_rank[r][name][i], part, plain_part,
                   floor=default_floor(torch.float32))


# ------------------------------------------------------------ unsupported and mistaken values
def _tensors_for(name):
    q, k, v, _ = _inputs(0, 1, 8, 8, 2, 2)
    if "qkvpacked" in name:
        return (torch.stack([q, k, v], dim=2),)
    if "kvpacked" in name:
        return q, torch.stack([k, v], dim=2)
    return q, k, v


ALL = list(REFERENCE)
BAD = [  # (id, kwargs, exception, message fragments, functions)
    ("dropout", dict(dropout_p=0.1), NotImplementedError, ["dropout_p", "0.1"], ALL),
    ("dropout_range", dict(dropout_p=1.5), ValueError, ["dropout_p", "1.5", "[0, 1]"], ALL),
    # (a probability as torch's dropout takes it: before, a ValueError "[0, 1)" where the docs
    # promise NotImplementedError for any dropout_p > 0)
    ("dropout_one", dict(dropout_p=1.0), NotImplementedError, ["dropout_p", "1.0"], ALL),
    ("dropout_none", dict(dropout_p=None), TypeError, ["dropout_p", "None"], ALL),
    ("dropout_bool", dict(dropout_p=True), TypeError, ["dropout_p", "True"], ALL),
    ("scale_str", dict(softmax_scale="0.5"), TypeError, ["softmax_scale", "'0.5'"], ALL),
    ("scale_bool", dict(softmax_scale=True), TypeError, ["softmax_scale", "True"], ALL),
    ("scale_tensor", dict(softmax_scale=torch.tensor(0.5)), TypeError,
     ["softmax_scale", "Tensor"], ALL),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, ["softmax_scale", "nan"], ALL),
    ("causal_int", dict(causal=1), TypeError, ["causal", "1 (int)"], ALL),
    ("causal_none", dict(causal=None), TypeError, ["causal", "None"], ALL),
    ("causal_str", dict(causal="True"), TypeError, ["causal", "'True'"], ALL),
    ("window_int", dict(window_size=8), TypeError, ["window_size", "8"], ALL),
    ("window_range", dict(window_size=(-2, -1)), ValueError, ["window_size", "-2"], ALL),
    # (before: torch's "Tensor.item() cannot be called on meta tensors" and int()'s complex error)
    ("window_meta", dict(window_size=torch.tensor([1, 2], device="meta")), TypeError,
     ["window_size", "on the meta device (no values)"], ALL),
    ("window_complex", dict(window_size=torch.tensor([1 + 0j, 2 + 0j])), TypeError,
     ["window_size", "of dtype torch.complex64"], ALL),
    ("softcap_negative", dict(softcap=-1.0), ValueError, ["softcap", "-1.0"], ALL),
    ("softcap_none", dict(softcap=None), TypeError, ["softcap", "None"], ALL),
    ("alibi", dict(alibi_slopes=torch.ones(2)), NotImplementedError, ["alibi_slopes"], ALL),
    ("deterministic_none", dict(deterministic=None), TypeError, ["deterministic"], ALL),
    ("attn_probs_int", dict(return_attn_probs=1), TypeError, ["return_attn_probs"], ALL),
    ("return_lse_int", dict(return_lse=1), TypeError, ["return_lse"], ALL),
    ("both_returns", dict(return_attn_probs=True, return_lse=True), ValueError,
     ["return_attn_probs", "return_lse"], ALL),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_unsupported_value_raises_naming_it(bad):
    _, kwargs, exc, fragments, names = bad
    for name in names:
        with pytest.raises(exc) as info:
            getattr(ringseq, name)(*_tensors_for(name), **kwargs)
        msg = str(info.value)
        for frag in [name, *fragments]:
            assert frag in msg, f"{name}({kwargs}): {frag!r} not in {msg!r}"


def test_dropout_raises_in_eval_too():
    """flash-attn applies dropout_p whether or not the model trains; ringseq has none."""
    with torch.no_grad():
        for name in ALL:
            with pytest.raises(NotImplementedError, match="dropout_p"):
                getattr(ringseq, name)(*_tensors_for(name), 0.1)


def test_deterministic_is_accepted_and_repeatable():
    for name in ALL:
        t = _tensors_for(name)
        a = getattr(ringseq, name)(*t, causal=True, deterministic=True)
        b = getattr(ringseq, name)(*t, causal=True, deterministic=False)
        assert torch.equal(a, b), name


def test_extras_cannot_be_positional():
    """backend, return_lse, layout, ... are keyword-only: one positional argument past the
    documented list is a TypeError."""
    for name in ALL:
        defaults = [d for _, d in _parse(REFERENCE[name])][len(_tensors_for(name)):]
        with pytest.raises(TypeError, match="positional"):
            getattr(ringseq, name)(*_tensors_for(name), *defaults, "reference")


@pytest.mark.parametrize("call, exc, frag", [
    # ringseq 0.1's (q, k, v, softmax_scale, causal, return_lse, backend)
    (lambda q, k, v: ringseq.flash_attn_func(q, k, v, 0.3, False, True, "reference"),
     NotImplementedError, "dropout_p"),
    (lambda q, k, v: ringseq.flash_attn_func(q, k, v, 0.125), NotImplementedError, "dropout_p"),
    # ringseq 0.1's (q, k, v, softmax_scale, causal, group, layout, ...)
    (lambda q, k, v: ringseq.ring_flash_attn_func(q, k, v, 0.125, True), NotImplementedError,
     "dropout_p"),
    (lambda q, k, v: ringseq.ring_flash_attn_func(q, k, v, None, True), TypeError, "dropout_p"),
    (lambda q, k, v: ringseq.ring_flash_attn_func(q, k, v, 0.0, True), TypeError,
     "softmax_scale"),
], ids=["flash_old_order", "flash_old_scale", "ring_old_order", "ring_old_default_scale",
        "ring_old_zero_scale"])
def test_old_ringseq_positional_calls_fail_loudly(call, exc, frag):
    with pytest.raises(exc, match=frag) as info:
        call(*_tensors_for("flash_attn_func"))
    if frag == "dropout_p":  # the message says why a scale landed in dropout_p
        assert re.search(r"the 4th positional argument of (ring_)?flash_attn_func is dropout_p",
                         str(info.value)), str(info.value)


@pytest.mark.parametrize("name, place", [("flash_attn_qkvpacked_func", "2nd"),
                                         ("flash_attn_kvpacked_func", "3rd"),
                                         ("flash_attn_varlen_func", "8th")])
def test_the_dropout_hint_names_its_place_in_each_function(name, place):
    """(before: every function's message said "the 4th positional argument is dropout_p")"""
    from ringseq._args import check_dropout
    with pytest.raises(NotImplementedError,
                       match=rf"the {place} positional argument of {name} is dropout_p"):
        check_dropout(name, 0.125)


@pytest.mark.parametrize("name", [n for n in ALL if "packed" in n])
def test_packed_shape_is_checked(name):
    q, k, v = _tensors_for("flash_attn_func")
    bad = (k,) if "qkvpacked" in name else (q, k)
    with pytest.raises(ValueError, match="kv must be"):
        getattr(ringseq, name)(*bad)


def test_shape_errors_name_the_tensors_and_shapes_the_caller_passed():
    """ring_sdpa: query / key / value in SDPA's (b, h, s, d); the varlen forms: (total, h, d)
    (before: q / k / v in flash-attn's (b, s, h, d), a batch dimension added)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g) for h in (4, 2, 2))  # (b, h, s, d)
    with pytest.raises(ValueError, match=r"^ring_sdpa: query and key/value must be shards of "
                                         r"one sequence .* got query \(1, 4, 8, 16\) and key "
                                         r"\(1, 2, 6, 16\)$"):
        ringseq.ring_sdpa(q, k[:, :, :6], v[:, :, :6])
    with pytest.raises(ValueError, match=r"^ring_sdpa: query, key and value must have the same "
                                         r"head dim .* value \(1, 2, 8, 8\)$"):
        ringseq.ring_sdpa(q, k, v[..., :8])
    with pytest.raises(ValueError, match=r"^ring_sdpa: nheads of query must be divisible by "
                                         r"nheads_kv of key and value, got nheads=4 and "
                                         r"nheads_kv=3$"):
        ringseq.ring_sdpa(q, *(torch.randn(1, 3, 8, 16) for _ in range(2)))
    qv, kv_, vv = (t[0].transpose(0, 1) for t in (q, k, v))  # (total, h, d)
    with pytest.raises(ValueError, match=r"^ring_flash_attn_varlen_func: q and k/v must be "
                                         r"shards of one sequence .* got q \(8, 4, 16\) and k "
                                         r"\(6, 2, 16\)$"):
        ringseq.ring_flash_attn_varlen_func(qv, kv_[:6], vv[:6], [0, 8])
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: k and v must have the same "
                                         r"shape, got k \(8, 2, 16\) and v \(8, 4, 16\)$"):
        ringseq.flash_attn_varlen_func(qv, kv_, qv, [0, 8], [0, 8], 8, 8)
    # a module's documents come from its layout (before: "cu_seqlens must be ...", an argument
    # RingAttention does not have)
    from ringseq.layouts import Documents
    module = ringseq.RingAttention(layout=Documents([0, 4, 24]))
    with pytest.raises(ValueError, match=r"^RingAttention: the boundaries of layout "
                                         r"Documents\(cu_seqlens\) must be the GLOBAL document "
                                         r"boundaries .* got boundaries ending at 24"):
        module(*(t.transpose(1, 2) for t in (q, k, v)))


def test_ring_sdpa_and_module_check_their_arguments():
    q, k, v = (t.transpose(1, 2) for t in _tensors_for("flash_attn_func"))
    with pytest.raises(TypeError, match="ring_sdpa: scale must be a float"):
        ringseq.ring_sdpa(q, k, v, scale="0.5")
    with pytest.raises(TypeError, match="ring_sdpa: is_causal must be a bool"):
        ringseq.ring_sdpa(q, k, v, is_causal=1)
    # NumPy's bools are bools, as for every other flag (before: refused here)
    import numpy as np
    torch.testing.assert_close(ringseq.ring_sdpa(q, k, v, is_causal=np.bool_(True)),
                               ringseq.ring_sdpa(q, k, v, is_causal=True), rtol=0, atol=0)
    # a non-tensor is the wrong kind, as everywhere else (before: ValueError in these two)
    with pytest.raises(TypeError, match=r"^ring_sdpa: query must be a 4-dim tensor \(batch, "
                                        r"nheads, seqlen, headdim\), got None \(NoneType\)"):
        ringseq.ring_sdpa(None, k, v)
    with pytest.raises(TypeError, match=r"^ring_flash_attn_varlen_func: q must be a 3-dim "
                                        r"tensor \(total_local, nheads, headdim\), got 'x' "
                                        r"\(str\)"):
        ringseq.ring_flash_attn_varlen_func("x", k[0], v[0], [0, k.shape[2]])
    with pytest.raises(ValueError, match=r"^ring_sdpa: query must be a 4-dim tensor \(batch, "
                                         r"nheads, seqlen, headdim\), got 3 dims with shape"):
        ringseq.ring_sdpa(q[0], k, v)
    with pytest.raises(TypeError, match="RingAttention: causal must be a bool"):
        ringseq.RingAttention(causal="yes")
    with pytest.raises(TypeError, match="RingAttention: softmax_scale must be a float"):
        ringseq.RingAttention(softmax_scale=True)
    # at construction (before: accepted, refused at the first forward)
    with pytest.raises(ValueError, match="^RingAttention: backend must be one of .*got 'nope'"):
        ringseq.RingAttention(backend="nope")
    with pytest.raises(ValueError, match="^RingAttention: grad_comm_dtype must be None, 'input', "
                                         ".*got torch.int8"):
        ringseq.RingAttention(grad_comm_dtype=torch.int8)
    with pytest.raises(TypeError, match="^RingAttention: group must be a torch.distributed "
                                        "ProcessGroup or None .*got 'world' \\(str\\)"):
        ringseq.RingAttention(group="world")
    # built inside a compiled function: the group's type is checked, nothing more
    compiled = torch.compile(lambda x: ringseq.RingAttention(causal=True)(x, x, x),
                             fullgraph=True, backend="eager")
    x = q.transpose(1, 2)
    assert torch.equal(compiled(x), ringseq.RingAttention(causal=True)(x, x, x))
    # the repr shows what changes the output (before: the same text for these two)
    assert repr(ringseq.RingAttention(causal=True)) == (
        "RingAttention(layout='contiguous', causal=True, backend=None)")
    assert repr(ringseq.RingAttention(causal=True, softmax_scale=3.0, grad_comm_dtype="input")) \
        == ("RingAttention(layout='contiguous', causal=True, backend=None, softmax_scale=3.0, "
            "grad_comm_dtype='input')")
    # SDPA's order: the 5th positional argument is dropout_p; ringseq has no dropout
    with pytest.raises(NotImplementedError, match="ring_sdpa: dropout_p=0.1 is not supported.*"
                       "5th positional argument is dropout_p.*pass the scale as scale="):
        ringseq.ring_sdpa(q, k, v, None, 0.1)
    # per-batch documents layouts need cu_seqlens, which these two do not take: refused up
    # front, pointing at a bound layout or ring_flash_attn_func
    with pytest.raises(ValueError, match="RingAttention: layout 'documents' is per batch.*"
                       r"ringseq.layouts.Documents\(cu_seqlens\)"):
        ringseq.RingAttention(layout="documents")
    with pytest.raises(ValueError, match="ring_sdpa: layout 'documents_zigzag' is per batch"):
        ringseq.ring_sdpa(q, k, v, layout="documents_zigzag")
    bound = ringseq.layouts.Documents([0, q.shape[2]])
    out = ringseq.RingAttention(layout=bound)(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(out, ringseq.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v))))


# ------------------------------------------------------------ varlen packed forms, lse of empty rows
# flash-attn 2 (v2.6+) varlen signatures.
_FA2_VARLEN_TAIL = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                    "softcap=0.0, alibi_slopes=None, deterministic=False, "
                    "return_attn_probs=False")
FLASH_ATTN_2_VARLEN = {
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                              + _FA2_VARLEN_TAIL + ", block_table=None",
    "flash_attn_varlen_kvpacked_func": "q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                       "max_seqlen_k, " + _FA2_VARLEN_TAIL,
    "flash_attn_varlen_qkvpacked_func": "qkv, cu_seqlens, max_seqlen, " + _FA2_VARLEN_TAIL,
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_VARLEN))
def test_varlen_signature_matches_reference(name):
    sig = inspect.signature(getattr(ringseq, name))
    params = list(sig.parameters.values())
    positional = [(p.name, p.default) for p in params
                  if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == _parse(FLASH_ATTN_2_VARLEN[name]), f"{name}{sig}"
    others = params[len(positional):]
    assert {p.name for p in others} == {"return_lse", "backend"}
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in others)
    assert name in ringseq.__all__


def test_varlen_packed_forms_equal_the_unpacked_one():
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 5, 17, 32], dtype=torch.int32)
    q, k, v = (torch.randn(32, n, 16, generator=g) for n in (4, 2, 2))
    kw = dict(causal=True, window_size=(6, 0), softcap=2.0, return_attn_probs=True)
    want = ringseq.flash_attn_varlen_func(q, k, v, cu, cu, 15, 15, **kw)
    kvp = ringseq.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 15, 15, **kw)
    for a, b in zip(want[:2], kvp[:2]):
        assert torch.equal(a, b)
    # qkvpacked: one head count for q, k and v (no GQA in this form)
    qkv = torch.stack([q, q, q], 1).requires_grad_()
    got = ringseq.flash_attn_varlen_qkvpacked_func(qkv, cu, 15, causal=True)
    ref = ringseq.flash_attn_varlen_func(q, q, q, cu, cu, 15, 15, causal=True)
    assert torch.equal(got, ref)
    got.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    with pytest.raises(ValueError, match=r"flash_attn_varlen_kvpacked_func: kv must be "
                                         r"\(total, 2, nheads_kv, headdim\)"):
        ringseq.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v, v], 1), cu, cu, 15, 15)


def test_rows_that_see_no_key_follow_flash_attn_lse_convention():
    """flash-attn's return_attn_probs gives lse = +inf for a row that sees no key (its kernels
    write +inf so that exp(score - lse) is 0); ringseq's return_lse keeps -inf (what the ring
    merges with); out is 0 either way."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 2, 8, generator=g)
    k = torch.randn(1, 3, 2, 8, generator=g)  # causal, s_q > s_k: rows 0..2 see nothing
    out, lse, none = ringseq.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert none is None
    assert torch.isposinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    assert (out[:, :3] == 0).all()
    _, lse2 = ringseq.flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert torch.isneginf(lse2[..., :3]).all() and torch.equal(lse2[..., 3:], lse[..., 3:])
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 3], dtype=torch.int32)  # the first sequence has no key
    _, lse3, _ = ringseq.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu_k, 3, 3,
                                                return_attn_probs=True)
    assert torch.isposinf(lse3[:, :3]).all() and torch.isfinite(lse3[:, 3:]).all()
    _, lse4, _ = ringseq.ring_flash_attn_func(q[:, :3], k, k, causal=False,
                                              window_size=(0, 0), return_attn_probs=True)
    assert torch.isfinite(lse4).all()  # (every row sees its own key)


def test_a_strided_head_dim_is_named_by_its_own_stride():
    """(before: flash_attn_varlen_func showed the strides of its internal 4-dim view of the
    3-dim input, (512, 64, 32, 2) for a tensor whose strides are (64, 32, 2))"""
    q = torch.randn(8, 2, 32)[..., ::2]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: q must be contiguous in its "
                                         r"last \(head\) dimension, got a stride of 2 there"):
        ringseq.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)


def test_packed_forms_name_what_the_caller_passed():
    """The packed forms' errors name their own arguments: qkv's parts, one cu_seqlens and
    max_seqlen (before: q / k / v, cu_seqlens_k and max_seqlen_q, which they do not take)."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(10, 3, 2, 32, generator=g)[..., ::2]  # (total, 3, h, d), head stride 2
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for fn, args, words in (
            ("flash_attn_varlen_qkvpacked_func", (qkv.contiguous(), cu, 3),
             "max_seqlen must be >= the longest sequence (6), got 3"),
            ("flash_attn_varlen_qkvpacked_func", (qkv.contiguous(), cu, 6.0),
             "max_seqlen must be an int"),
            ("flash_attn_varlen_qkvpacked_func", (qkv.contiguous(), cu[:-1], 6),
             "cu_seqlens must end at the packed length (10), got 4"),
            ("flash_attn_varlen_qkvpacked_func", (qkv, cu, 6),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("flash_attn_varlen_kvpacked_func", (qkv[:, 0].contiguous(), qkv[:, 1:], cu, cu, 6, 6),
             "kv's k part must be contiguous in its last (head) dimension"),
            ("flash_attn_qkvpacked_func", (qkv[None],),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("flash_attn_kvpacked_func", (qkv[None, :, 0].contiguous(), qkv[None, :, 1:]),
             "kv's k part must be contiguous in its last (head) dimension"),
            ("ring_flash_attn_qkvpacked_func", (qkv[None],),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("ring_flash_attn_kvpacked_func", (qkv[None, :, 0].contiguous(), qkv[None, :, 1:]),
             "kv's k part must be contiguous in its last (head) dimension"),
            ("zigzag_ring_flash_attn_qkvpacked_func", (qkv[None],),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("stripe_flash_attn_qkvpacked_func", (qkv[None],),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("zigzag_ring_flash_attn_kvpacked_func", (qkv[None, :, 0].contiguous(),
                                                      qkv[None, :, 1:]),
             "kv's k part must be contiguous in its last (head) dimension"),
            ("stripe_flash_attn_kvpacked_func", (qkv[None, :, 0].contiguous(), qkv[None, :, 1:]),
             "kv's k part must be contiguous in its last (head) dimension"),
            ("ring_flash_attn_varlen_qkvpacked_func", (qkv, cu),
             "qkv's q part must be contiguous in its last (head) dimension"),
            ("ring_flash_attn_varlen_kvpacked_func", (qkv[:, 0].contiguous(), qkv[:, 1:], cu),
             "kv's k part must be contiguous in its last (head) dimension")):
        with pytest.raises((TypeError, ValueError), match=f"^{fn}: {re.escape(words)}"):
            getattr(ringseq, fn)(*args)


# ring-flash-attention's varlen ring signatures (ringseq defaults max_seqlen to None: unused)
_RFA_VARLEN = {
    "ring_flash_attn_varlen_func": ["q", "k", "v"],
    "ring_flash_attn_varlen_kvpacked_func": ["q", "kv"],
    "ring_flash_attn_varlen_qkvpacked_func": ["qkv"],
}


@pytest.mark.parametrize("name", list(_RFA_VARLEN))
def test_ring_varlen_signatures_follow_ring_flash_attention(name):
    """(before: the kv- and qkv-packed varlen ring functions did not exist)"""
    want = _parse(", ".join(_RFA_VARLEN[name]) + ", cu_seqlens, max_seqlen=None, " + _RFA_TAIL)
    params = list(inspect.signature(getattr(ringseq, name)).parameters.values())
    positional = [(p.name, p.default) for p in params
                  if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == want, name
    assert {p.name for p in params[len(positional):]} == {
        "layout", "return_lse", "backend", "grad_comm_dtype", "softcap"}
    assert name in ringseq.__all__


def _ring_varlen_packed_forms():
    g = torch.Generator().manual_seed(4)
    cu = [0, 5, 5, 17, 32]
    layout = ringseq.layouts.Documents(cu)  # the varlen functions' default layout
    q, k, v = (ringseq.shard(torch.randn(32, n, 16, generator=g), layout, dim=0).requires_grad_()
               for n in (4, 2, 2))  # (16, h, 16) on each of 2 ranks
    kv = torch.stack([k.detach(), v.detach()], 1).requires_grad_()
    qkv = torch.stack([q.detach(), k.detach().repeat_interleave(2, 1)[:, :4],
                       v.detach().repeat_interleave(2, 1)[:, :4]], 1).requires_grad_()
    kw = dict(causal=True, window_size=(6, 0), softcap=2.0)
    want = ringseq.ring_flash_attn_varlen_func(q, k, v, cu, **kw)
    got_kv = ringseq.ring_flash_attn_varlen_kvpacked_func(q, kv, cu, **kw)
    want.square().sum().backward()
    got_kv.square().sum().backward()
    want_qkv = ringseq.ring_flash_attn_varlen_func(*qkv.detach().unbind(1), cu, **kw)
    got_qkv = ringseq.ring_flash_attn_varlen_qkvpacked_func(qkv, cu, **kw)
    got_qkv.sum().backward()
    return {"kv": (got_kv - want).abs().max().item(),
            "dkv": (kv.grad - torch.stack([k.grad, v.grad], 1)).abs().max().item(),
            "qkv": (got_qkv - want_qkv).abs().max().item(),
            "dqkv_shape": tuple(qkv.grad.shape)}


def test_ring_varlen_packed_forms_equal_the_unpacked_one():
    for res in run_ranks(_ring_varlen_packed_forms, 2, timeout=120):
        assert res["kv"] == 0 and res["dkv"] == 0 and res["qkv"] == 0, res
        assert res["dqkv_shape"] == (16, 3, 4, 16), res
