"""flash-attn 2's private block functions, as ring-flash-attention calls them, over torch's CPU
flash op (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward).

Tensors are flash-attn's ``(batch, seqlen, nheads, headdim)``; the lse is ``(batch, nheads,
seqlen)`` float32. Only what a benchmark of the ring loops needs is supported: no dropout,
windows, softcap or ALiBi (each raises), equal head counts for q and k/v, and, as flash-attn 2
itself, fp16 and bf16 inputs only (float32 raises: a peer run in float32 would be one no real
installation can make). The varlen functions
exist so the package imports; calling them raises.
"""
import torch

aten = torch.ops.aten


def _refuse(q, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"peer stand-in: flash-attn 2 takes fp16 and bf16 inputs only, got "
                           f"{q.dtype}")
    if q.shape[-1] > 256:  # (before: timed, a setup no flash-attn 2 installation runs)
        raise RuntimeError(f"peer stand-in: flash-attn 2 takes head dims up to 256, got "
                           f"{q.shape[-1]}")
    if dropout_p:
        raise NotImplementedError(f"peer stand-in: dropout_p={dropout_p}, only 0 is supported")
    if (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError("peer stand-in: window_size must be (-1, -1), got "
                                  f"({window_size_left}, {window_size_right})")
    if softcap:
        raise NotImplementedError(f"peer stand-in: softcap={softcap}, only 0 is supported")
    if alibi_slopes is not None:
        raise NotImplementedError("peer stand-in: alibi_slopes are not supported")


def _bhsd(x):
    return x.transpose(1, 2)


def _flash_attn_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size_left=-1, window_size_right=-1, softcap=0.0,
                        alibi_slopes=None, return_softmax=False):
    """Returns ``(out, softmax_lse, None, None)`` as flash-attn 2.6+ does."""
    _refuse(q, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, bool(causal), scale=softmax_scale)
    return _bhsd(out), lse.float(), None, None  # (b, s, h, d), (b, h, s)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p=0.0,
                         softmax_scale=None, causal=False, window_size_left=-1,
                         window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (as flash-attn does) and returns them."""
    _refuse(q, dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), softmax_lse, 0.0, bool(causal),
        scale=softmax_scale)
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        dst.copy_(_bhsd(src))
    return dq, dk, dv


def _flash_attn_varlen_forward(*args, **kwargs):
    raise NotImplementedError("peer stand-in: the varlen block functions are not provided")


def _flash_attn_varlen_backward(*args, **kwargs):
    raise NotImplementedError("peer stand-in: the varlen block functions are not provided")
