"""Exact merge of two partial attention results over disjoint key sets (docs/design.md, "Ring math")."""
from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor) -> None:
    """Merges a block result (o_b, l_b) into the running (out, lse), in place.

    out (b, s, h, d) and lse (b, h, s) in the accumulation dtype (views allowed); o_b in any
    float dtype, l_b like lse. With l' = logaddexp(lse, l_b):
    out' = exp(lse - l')·out + exp(l_b - l')·o_b. Rows where both are -inf have NaN weights,
    which are zeroed so the row stays out = 0, lse = -inf; a row with lse = -inf has weight 0,
    so whatever its out holds (even NaN) does not leak in.
    """
    new = torch.logaddexp(lse, l_b)  # (b, h, s)
    w = torch.exp(lse - new).nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    w_b = torch.exp(l_b - new).nan_to_num_(0.0).transpose(1, 2).unsqueeze(-1)
    out.mul_(w).masked_fill_(w == 0, 0.0).addcmul_(o_b, w_b)  # 0 · (NaN garbage) stays 0
    lse.copy_(new)
