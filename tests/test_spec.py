"""The AttnSpec: every option of an attention call resolved and validated once.

- its string encoding for the custom operator round-trips;
- one ring call (forward and backward, 2 gloo ranks, windows + documents + softcap) runs each
  validation exactly once per rank: nothing below the entry point re-checks;
- every argument error names the function that was called, in one style.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import ringseq
from dist_utils import run_ranks
from ringseq.kernels.checks import CHECK_COUNTS
from ringseq.spec import attn_spec, spec_from_key


def _qkv(s=16, h=4, hkv=2, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv)]


@pytest.mark.parametrize("kw", [
    {},
    {"causal": True, "window_size": (3, 0), "softcap": 2.5, "softmax_scale": 0.3},
    {"grad_comm_dtype": "input", "backend": "reference"},
    {"grad_comm_dtype": torch.bfloat16, "window_size": (-1, 7)},
])
def test_key_round_trip(kw):
    q, k, v = _qkv()
    spec = attn_spec("f", q, k, v, documents=[0, 5, 16], **kw)
    back = spec_from_key(spec.key(), spec.documents_tensor())
    assert back == spec  # every option survives the encoding (spans aside: tensors)
    assert spec_from_key(spec.key()).documents is None
    assert back.signature((1, 16, 4, 8), 2, q.dtype) == spec.signature((1, 16, 4, 8), 2, q.dtype)


def test_window_size_as_flash_attn_tests_pass_it():
    q, k, v = _qkv()
    for window in ((3, 0), torch.tensor([3, 0]), (torch.tensor(3), torch.tensor(0))):
        assert attn_spec("f", q, k, v, window_size=window).window == (3, 0)
    with pytest.raises(TypeError, match=r"^f: window_size must be a pair"):
        attn_spec("f", q, k, v, window_size=(3.0, 0))


@pytest.mark.parametrize("window", [(2 ** 62, 0), (2 ** 63 - 1, -1), (0, 2 ** 64),
                                    (2 ** 70, 2 ** 70)])
@pytest.mark.parametrize("s_q, s_k", [(9, 5), (5, 9)])
def test_windows_wider_than_any_sequence_are_none(window, s_q, s_k):
    """Any width from 2**62 on is unbounded for every sequence, so it is the same call as -1
    there, at every entry point (before: int64 overflow errors from inside the planner, or the
    kv-cache operator refusing the int)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, s_q, 2, 16, generator=g)
    k, v = (torch.randn(2, s_k, 2, 16, generator=g) for _ in range(2))
    same = tuple(-1 if w >= 2 ** 62 else w for w in window)
    assert attn_spec("f", q, k, v, window_size=window).window == same
    got = ringseq.flash_attn_func(q, k, v, window_size=window)
    assert torch.equal(got, ringseq.flash_attn_func(q, k, v, window_size=same))
    cu_q, cu_k = torch.tensor([0, s_q, 2 * s_q]), torch.tensor([0, s_k, 2 * s_k])
    flat = [t.reshape(-1, 2, 16) for t in (q, k, v)]
    got = ringseq.flash_attn_varlen_func(*flat, cu_q, cu_k, s_q, s_k, window_size=window)
    assert torch.equal(got, ringseq.flash_attn_varlen_func(*flat, cu_q, cu_k, s_q, s_k,
                                                           window_size=same))
    got = ringseq.flash_attn_with_kvcache(q[:, :1], k, v, window_size=window)
    assert torch.equal(got, ringseq.flash_attn_with_kvcache(q[:, :1], k, v, window_size=same))


def test_a_max_seqlen_wider_than_any_window_opens_the_right_side_as_unbounded():
    """flash-attn's rule: a window (left, -1) reaches max_seqlen_k to the right; a max_seqlen_k
    of 2**63 is unbounded too (before: an int64 overflow packing the spans)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 2, 16, generator=g) for _ in range(3))  # (total, h, d)
    cu = torch.tensor([0, 8])
    got = ringseq.flash_attn_varlen_func(q, k, v, cu, cu, 8, 2 ** 63, window_size=(2, -1))
    assert torch.equal(got, ringseq.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8,
                                                           window_size=(2, -1)))


def test_out_of_range_numbers_are_refused_by_name():
    """(before: softcap=10**400 raised a bare OverflowError; a tensor softcap printed its
    values; a NumPy float16 softmax_scale warned twice of an overflow in a cast)"""
    import warnings

    import numpy as np
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^flash_attn_func: softcap must be 0.0 \(off\) or within "
                                         r"float32's range .*, got a value past float's range "
                                         r"\(int\)$"):
        ringseq.flash_attn_func(q, q, q, softcap=10 ** 400)
    with pytest.raises(TypeError, match=r"^flash_attn_func: softcap must be a float \(0.0: off\), "
                                        r"got a torch.Tensor of shape \(2, 3\)$"):
        ringseq.flash_attn_func(q, q, q, softcap=torch.full((2, 3), 5.0))
    from fractions import Fraction
    with pytest.raises(ValueError, match=r"^flash_attn_func: softmax_scale must be within "
                                         r"float32's range"):
        ringseq.flash_attn_func(q, q, q, softmax_scale=Fraction(10 ** 400))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ringseq.flash_attn_func(q, q, q, softmax_scale=np.float16(0.25))
    assert torch.equal(got, ringseq.flash_attn_func(q, q, q, softmax_scale=0.25))


@pytest.mark.parametrize("kw, exc, text", [
    ({"dropout_p": 0.1}, NotImplementedError, "dropout_p=0.1"),
    ({"softmax_scale": True}, TypeError, "softmax_scale must be a float"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"softcap": -1.0}, ValueError, "softcap must be a finite float >= 0"),
    ({"window_size": (-2, 0)}, ValueError, "window_size entries must be >= 0"),
    ({"backend": "nope"}, ValueError, "backend must be one of"),
    ({"grad_comm_dtype": "float32"}, ValueError, "grad_comm_dtype must be None"),
    # (before: accepted; the backward then failed in torch's promotion on one rank and broke
    # the ring)
    ({"grad_comm_dtype": torch.float8_e4m3fn}, ValueError,
     r"grad_comm_dtype must be None, 'input', torch.float16, torch.bfloat16, torch.float32 or "
     r"torch.float64, got torch.float8_e4m3fn"),
    ({"documents": [0, 9, 4, 16]}, ValueError, "cu_seqlens must start at 0 and never decrease"),
    ({"documents": [0]}, ValueError, "cu_seqlens needs at least one sequence"),
    # (before: a string's characters were listed, a float tensor was a ValueError and a meta
    # tensor raised torch's "Cannot copy out of meta tensor", naming neither)
    ({"documents": "0,9,16"}, TypeError, r"cu_seqlens must be a 1-D int32 / int64 tensor or a "
                                         r"sequence of ints, got '0,9,16' \(str\)"),
    ({"documents": torch.tensor([0.0, 9.0, 16.0])}, TypeError,
     "cu_seqlens must be an int32 or int64 tensor .*got torch.float32"),
    ({"documents": torch.tensor([0, 9, 16], device="meta")}, ValueError,
     "cu_seqlens must hold its values .*on the meta device"),
    ({"alibi_slopes": torch.ones(4)}, NotImplementedError, "alibi_slopes is not supported"),
])
def test_errors_name_the_function_and_the_argument(kw, exc, text):
    q, k, v = _qkv()
    with pytest.raises(exc, match=rf"^my_fn: .*{text}"):
        attn_spec("my_fn", q, k, v, **kw)


def test_varlen_max_seqlen_is_any_integer_at_least_the_longest_sequence():
    """flash-attn takes max_seqlen as any integer (before: NumPy's np.diff(cu).max() was refused
    with "must be an int >= the longest sequence (9), got np.int64(9)", and True passed the
    kind check as a ValueError)."""
    np = pytest.importorskip("numpy")
    q = torch.randn(16, 2, 8)
    cu = torch.tensor([0, 9, 16], dtype=torch.int32)
    want = ringseq.flash_attn_varlen_func(q, q, q, cu, cu, 9, 9)
    longest = np.diff(np.array([0, 9, 16])).max()  # np.int64(9)
    for mx in (longest, torch.tensor(9), 12, np.int32(9)):
        assert torch.equal(ringseq.flash_attn_varlen_func(q, q, q, cu, cu, mx, mx), want)
    for bad in (True, 9.0, "9", torch.tensor([9]), torch.tensor(True),
                torch.tensor(9, device="meta")):
        with pytest.raises(TypeError, match=r"^flash_attn_varlen_func: max_seqlen_q must be an "
                                            r"int \(the longest sequence, 9, or more\), got "):
            ringseq.flash_attn_varlen_func(q, q, q, cu, cu, bad, 9)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: max_seqlen_k must be >= "
                                         r"the longest sequence \(9\), got 8$"):
        ringseq.flash_attn_varlen_func(q, q, q, cu, cu, 9, np.int32(8))


def test_document_boundaries_in_any_sequence_of_ints():
    """cu_seqlens as a list, tuple, range, bytes, NumPy array or int32 / int64 tensor give the
    same result; a string is refused (its characters are no boundaries)."""
    np = pytest.importorskip("numpy")
    q = torch.randn(1, 16, 2, 8)
    want = ringseq.ring_flash_attn_func(q, q, q, causal=True, cu_seqlens=[0, 9, 16])
    for cu in ((0, 9, 16), bytes([0, 9, 16]), np.array([0, 9, 16]),
               torch.tensor([0, 9, 16], dtype=torch.int32), [np.int64(0), 9, 16]):
        got = ringseq.ring_flash_attn_func(q, q, q, causal=True, cu_seqlens=cu)
        assert torch.equal(got, want), type(cu)


def test_tensor_errors_name_the_function():
    q, k, v = _qkv()
    # a missing tensor is a TypeError in every form (before: ValueError in the varlen forms)
    flat, cu = q.reshape(-1, *q.shape[2:]), torch.tensor([0, q.shape[1]], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^flash_attn_varlen_func: k must be a 3-dim tensor "
                                        r"\(total, nheads_kv, headdim\), got None"):
        ringseq.flash_attn_varlen_func(flat, None, flat, cu, cu, q.shape[1], q.shape[1])
    with pytest.raises(TypeError, match=r"^flash_attn_varlen_kvpacked_func: kv must be a tensor"):
        ringseq.flash_attn_varlen_kvpacked_func(flat, None, cu, cu, q.shape[1], q.shape[1])
    with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: headdim must be positive"):
        ringseq.flash_attn_with_kvcache(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(ValueError, match=r"^ring_flash_attn_func: group=.* was passed but "
                                         r"torch.distributed is not initialized"):
        ringseq.ring_flash_attn_func(q, k, v, group=-100)  # what new_group gives non-members
    with pytest.raises(TypeError, match=r"^ring_flash_attn_func: group must be a "
                                        r"torch.distributed ProcessGroup"):
        ringseq.ring_flash_attn_func(q, k, v, group=object())
    with pytest.raises(ValueError, match=r"^g: q, k and v must be tensors with data"):
        attn_spec("g", q, k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match=r"^ring_flash_attn_func: q, k and v must have the same "
                                         r"dtype"):
        ringseq.ring_flash_attn_func(q, k.double(), v)


def _wrong_tensor_cases():
    """(id, call, error, message) for each form's q/k/v: one rule (InputForm.to_flash), each
    form's own names and shapes."""
    q, k, v = _qkv()  # (1, 16, 4, 8), (1, 16, 2, 8) x 2
    flat = [t[0] for t in (q, k, v)]  # (16, h, 8)
    cu = [0, 16]
    int8 = [t.to(torch.int8) for t in (q, k, v)]
    flash = r"\(batch, seqlen_q, nheads, headdim\)"
    yield ("flash none", lambda: ringseq.flash_attn_func(None, k, v), TypeError,
           rf"^flash_attn_func: q must be a 4-dim tensor {flash}, got None \(NoneType\)")
    yield ("flash 3 dims", lambda: ringseq.flash_attn_func(q[0], k, v), ValueError,
           rf"^flash_attn_func: q must be a 4-dim tensor {flash}, got 3 dims with shape "
           rf"\(16, 4, 8\)")
    yield ("ring k str", lambda: ringseq.ring_flash_attn_func(q, "k", v), TypeError,
           r"^ring_flash_attn_func: k must be a 4-dim tensor \(batch, seqlen_k, nheads_kv, "
           r"headdim\), got 'k' \(str\)")
    yield ("sdpa key none", lambda: ringseq.ring_sdpa(q, None, v), TypeError,
           r"^ring_sdpa: key must be a 4-dim tensor \(batch, nheads_kv, seqlen, headdim\), got "
           r"None")
    # transformers' attention function: its (b, h, s, d) names and shapes, under the layer's name
    # (where transformers, an optional dependency, is installed: before, the whole suite stopped
    # at collection without it)
    if importlib.util.find_spec("transformers") is not None:
        from ringseq.integrations.transformers import RingSettings, ringseq_attention_forward

        class LlamaAttention(torch.nn.Module):
            ringseq_settings = RingSettings()

        yield ("transformers query",
               lambda: ringseq_attention_forward(LlamaAttention(), q.transpose(1, 2)[0],
                                                 k.transpose(1, 2), v.transpose(1, 2), None),
               ValueError, r"^LlamaAttention: query must be a 4-dim tensor \(batch, nheads, "
                           r"seqlen, headdim\), got 3 dims with shape \(4, 16, 8\)")
    yield ("varlen 4 dims",
           lambda: ringseq.flash_attn_varlen_func(q, *flat[1:], cu, cu, 16, 16), ValueError,
           r"^flash_attn_varlen_func: q must be a 3-dim tensor \(total, nheads, headdim\), got "
           r"4 dims with shape \(1, 16, 4, 8\)")
    yield ("ring varlen v",
           lambda: ringseq.ring_flash_attn_varlen_func(flat[0], flat[1], v, cu), ValueError,
           r"^ring_flash_attn_varlen_func: v must be a 3-dim tensor \(total_local, nheads_kv, "
           r"headdim\), got 4 dims")
    # the kv-cache functions: the same words for q, their own shapes for the caches
    yield ("kvcache q none", lambda: ringseq.flash_attn_with_kvcache(None, k, v), TypeError,
           rf"^flash_attn_with_kvcache: q must be a 4-dim tensor {flash}, got None \(NoneType\)")
    yield ("kvcache cache dims", lambda: ringseq.flash_attn_with_kvcache(q, k[0], v), ValueError,
           r"^flash_attn_with_kvcache: k_cache must be a 4-dim tensor \(batch_cache, "
           r"seqlen_cache, nheads_k, headdim\), got 3 dims")
    # a dtype the kernels do not compute is a ValueError everywhere (before: TypeError here)
    yield ("kvcache int8", lambda: ringseq.flash_attn_with_kvcache(*int8), ValueError,
           r"^flash_attn_with_kvcache: q, the caches and k, v must be float32, float64, "
           r"bfloat16 or float16, got torch.int8")
    yield ("flash int8", lambda: ringseq.flash_attn_func(*int8), ValueError,
           r"^flash_attn_func: q, k and v must be float32, float64, bfloat16 or float16, got "
           r"torch.int8")
    # the two decoding functions' one cache rule: the ring's names and its batch condition
    yield ("ring kvcache shapes",
           lambda: ringseq.ring_flash_attn_with_kvcache(q, k[:, :, :1], v, 0, prefill_len=0),
           ValueError,
           r"^ring_flash_attn_with_kvcache: k_cache_shard and v_cache_shard must both be "
           r"\(batch, capacity, nheads_k, headdim\) with batch 1, q's headdim 8 and nheads_k "
           r"dividing nheads = 4, got \(1, 16, 1, 8\) and \(1, 16, 2, 8\)")
    yield ("kvcache strides",
           lambda: ringseq.flash_attn_with_kvcache(q, k.transpose(1, 3), v), ValueError,
           r"^flash_attn_with_kvcache: k_cache must have q's dtype and device \(torch.float32 on "
           r"cpu\) and a contiguous last dimension, got torch.float32 on cpu, strides")


@pytest.mark.parametrize("call, error, message",
                         [pytest.param(*c[1:], id=c[0]) for c in _wrong_tensor_cases()])
def test_every_form_refuses_a_wrong_tensor_by_one_rule_in_its_own_words(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _count_one_call():
    import torch.distributed as dist
    q, k, v = (ringseq.shard(t, "contiguous").requires_grad_() for t in _qkv(s=32))
    kw = dict(causal=True, window_size=(6, 0), softcap=3.0, cu_seqlens=[0, 11, 32],
              layout="contiguous")
    ringseq.ring_flash_attn_func(q, k, v, **kw).sum().backward()  # warm-up (plans cached)
    dist.barrier()
    before = dict(CHECK_COUNTS)
    out = ringseq.ring_flash_attn_func(q, k, v, **kw)
    out.sum().backward()
    return {name: n - before.get(name, 0) for name, n in CHECK_COUNTS.items()}


def test_one_ring_call_validates_each_argument_once():
    for counts in run_ranks(_count_one_call, 2, timeout=180):
        assert counts == {"attn_spec": 1, "check_qkv": 1, "parse_window": 1,
                          "check_softcap": 1, "check_cu_seqlens": 1}, counts
