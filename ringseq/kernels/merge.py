"""Exact merge of two partial attention results over disjoint key sets (docs/design.md, "Ring math")."""
from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor) -> None:
    """Merges a block result (o_b, l_b) into the running (out, lse), in place.

    out (b, s, h, d) and lse (b, h, s) in the accumulation dtype (views allowed); o_b in any
    float dtype, l_b like lse. With l' = logaddexp(lse, l_b):
    out' = exp(lse - l')·out + exp(l_b - l')·o_b. Rows where both are -inf (nothing seen yet)
    get weights 0 instead of exp(-inf - -inf) = NaN, so they stay out = 0, lse = -inf; a side
    with lse = -inf has weight 0, so whatever its out holds does not leak in. A NaN in either
    lse or out is kept, as plain attention over the union of the keys would keep it.
    """
    new = torch.logaddexp(lse, l_b)  # (b, h, s); NaN if either is NaN
    empty = torch.isneginf(new)  # both sides saw nothing
    w = torch.exp(lse - new).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    w_b = torch.exp(l_b - new).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    # 0 · (garbage in an unseen row) must stay 0, but NaN weights must stay NaN.
    out.mul_(w).masked_fill_(w == 0, 0.0).addcmul_(o_b, w_b)
    lse.copy_(new)
