"""Shared test helpers: float64 reference attention and the tolerance rule of docs/design.md."""
from __future__ import annotations

import contextlib
import os
import time

import torch


def capture(fn):
    """What calling ``fn()`` did, for a rank to report to the test: ``("ok", value)`` or
    ``(error type name, message, seconds until it raised)``."""
    t0 = time.monotonic()
    try:
        return ("ok", fn())
    except BaseException as exc:  # noqa: BLE001 - the parent asserts on type and message
        # (SystemExit, KeyboardInterrupt too: a rank's own failure of those kinds)
        return (type(exc).__name__, str(exc), time.monotonic() - t0)


@contextlib.contextmanager
def node_copy(path, copy, active=True):
    """While the block runs (where ``active``: on the rank whose node is simulated), reads of
    the checkpoint file ``path`` through ``torch.load`` get the file ``copy``: one path that
    this rank's node holds with other contents (another step, truncated, garbage)."""
    real_load = torch.load
    if active:
        torch.load = lambda f, *a, **k: real_load(copy if f == path else f, *a, **k)
    try:
        yield
    finally:
        torch.load = real_load


def error_text(fn, catch=(Exception,)):
    """``"Type: message"`` of what calling ``fn()`` raised (only the types in ``catch`` are
    caught), or ``"no error"``: a rank returns it for the test to assert on."""
    try:
        fn()
    except catch as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _mask(s_q, s_k, device):
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_k, device=device)[None, :]
    return j <= i + (s_k - s_q)  # bottom-right aligned


def span_mask(spans, s_q, s_k, device=None):
    """(s_q, s_k) visibility of a list of spans (q_start, q_len, k_start, k_len, band_lo,
    band_hi), written from the definition: key j of span t is visible to its query i iff
    band_lo <= (j - k_start) - (i - q_start) <= band_hi."""
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_k, device=device)[None, :]
    mask = torch.zeros(s_q, s_k, dtype=torch.bool, device=device)
    for qs, ql, ks, kl, lo, hi in (tuple(int(x) for x in s) for s in spans):
        inside = (i >= qs) & (i < qs + ql) & (j >= ks) & (j < ks + kl)
        rel = (j - ks) - (i - qs)
        mask |= inside & (rel >= lo) & (rel <= hi)
    return mask


def plain_attention(q, k, v, softmax_scale=None, causal=False, dtype=None, *, spans=None,
                    softcap=0.0):
    """Textbook attention computed in `dtype` (default: q's dtype), autograd-friendly.

    q (b, s_q, h, d), k/v (b, s_k, h_kv, d). Returns (out (b, s_q, h, d), lse (b, h, s_q)).
    Rows that see no key give out 0 and lse -inf. ``spans``: see span_mask (instead of
    causal); ``softcap`` > 0 caps the scaled scores at softcap * tanh(x / softcap).
    """
    dtype = dtype or q.dtype
    h, h_kv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    kd = kd.repeat_interleave(h // h_kv, dim=2)
    vd = vd.repeat_interleave(h // h_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    if spans is not None:
        s = s.masked_fill(~span_mask(spans, q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(s.float() if dtype in (torch.float16, torch.bfloat16) else s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    return out, lse


def attention_reference(q, k, v, softmax_scale=None, causal=False):
    """float64 reference (out, lse); differentiable w.r.t. the float64 copies of q, k, v."""
    return plain_attention(q, k, v, softmax_scale, causal, dtype=torch.float64)


def reference_grads(q, k, v, dout, softmax_scale=None, causal=False, dtype=torch.float64, *,
                    spans=None, softcap=0.0):
    """(out, lse, dq, dk, dv) of plain attention computed in `dtype`, returned in `dtype`."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = plain_attention(qd, kd, vd, softmax_scale, causal, dtype=dtype, spans=spans,
                               softcap=softcap)
    dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout.to(dtype))
    return out.detach(), lse.detach(), dq, dk, dv


def max_err(a, b):
    """Max abs difference, treating matching infinities (lse = -inf rows) as equal."""
    a64, b64 = a.detach().double(), b.detach().double()
    both_inf = torch.isinf(a64) & torch.isinf(b64) & (torch.sign(a64) == torch.sign(b64))
    diff = (a64 - b64).abs().masked_fill(both_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_per_design(actual, reference64, plain, name="tensor", factor=2.0, floor=1e-5):
    """docs/design.md's tolerance: err(actual) <= factor * err(plain) + floor, both against the
    float64 reference (factor 2 for outputs, 3 for gradients). NaN anywhere fails."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in the tested result"
    assert actual.shape == reference64.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(reference64.shape)}"
    # -inf must match exactly (rows with no visible key)
    inf_a, inf_r = torch.isinf(actual), torch.isinf(reference64)
    assert torch.equal(inf_a, inf_r), f"{name}: infinities differ from the reference"
    err = max_err(actual, reference64)
    base = max_err(plain, reference64)
    bound = factor * base + floor
    assert err <= bound, (f"{name}: max error {err:.3e} vs float64 reference exceeds "
                          f"{factor}x plain-{plain.dtype} error {base:.3e} + {floor:.0e} = {bound:.3e}")
    return err, base


def default_floor(dtype):
    """Small absolute floor per dtype for the tolerance rule."""
    return {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}[dtype]


def scaled_floor(dtype, *references, ulps=4):
    """default_floor(dtype) plus `ulps` rounding units of the accumulation type (float64 for
    float64 inputs, float32 otherwise) at the largest finite magnitude of `references` (at
    least 1). Needed where plain attention is exact or nearly so by luck (one visible key:
    dS = dP - delta cancels to 0 in its formulation; a short float32 sum happening to round
    well) while any other correct summation order is a few ulps off at the scale of the
    values, which a fixed absolute 1e-6 cannot absorb for values of size ~5."""
    mag = 1.0
    for t in references:
        finite = t[torch.isfinite(t)]
        if finite.numel():
            mag = max(mag, float(finite.abs().max()))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return default_floor(dtype) + ulps * torch.finfo(acc).eps * mag


def token_dataset(n, seqlen, vocab, ignored=(7, 29), seed=3):
    """``n`` samples ``{"input_ids": (seqlen,), "labels": (seqlen,)}`` of random tokens, labels =
    ids; sample i ignores (-100) its first ``(a * i) % m`` labels for ``ignored = (a, m)``, so
    data-parallel groups see unequal target counts."""
    g = torch.Generator().manual_seed(seed)
    a, m = ignored
    data = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seqlen,), generator=g)  # (seqlen,)
        labels = ids.clone()
        labels[: (a * i) % m] = -100
        data.append({"input_ids": ids, "labels": labels})
    return data


class SwitchableAttention(torch.nn.Module):
    """Causal self-attention of ``width`` features in heads of 8 on the plugin's
    ``ringseq_switch`` convention (q, k, v, o separate Linear layers: ``tp_plan`` names)."""
    sdpa = staticmethod(torch.nn.functional.scaled_dot_product_attention)

    def __init__(self, width: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width) for _ in range(4))

    def ringseq_switch(self, group, layout, backend=None):
        from ringseq.plugin import sdpa_on_ring
        self.sdpa = sdpa_on_ring(group, layout, backend)

    def forward(self, x):
        b, s = x.shape[:2]
        q, k, v = (f(x).view(b, s, -1, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.o(self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


def isa_levels() -> list:
    """Every ISA level this CPU and build run, or only the one RINGSEQ_CPU_ISA forces (the
    re-runs of tests/test_isa_levels.py set it: each level once, not every level per re-run)."""
    from ringseq.kernels.extension import cpu_isa_levels
    forced = os.environ.get("RINGSEQ_CPU_ISA")
    levels = cpu_isa_levels()
    return [forced] if forced in levels else levels


@contextlib.contextmanager
def cpu_isa_forced(level: str):
    """The kernel at ISA ``level`` inside (RINGSEQ_CPU_ISA set, the cached choice dropped
    before and after, so the next kernel call reads the variable)."""
    import ringseq._C

    old = os.environ.get("RINGSEQ_CPU_ISA")
    os.environ["RINGSEQ_CPU_ISA"] = level
    ringseq._C._set_cpu_isa(None)
    try:
        assert ringseq._C.cpu_isa() == level
        yield level
    finally:
        if old is None:
            os.environ.pop("RINGSEQ_CPU_ISA", None)
        else:
            os.environ["RINGSEQ_CPU_ISA"] = old
        ringseq._C._set_cpu_isa(None)
