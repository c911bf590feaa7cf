"""A CPU stand-in for the parts of flash-attn that ring-flash-attention imports.

Only for ``benchmarks/bench_ring_vs_rfa.py``: it lets ring-flash-attention's own ring loops run
on CPU ranks with torch's CPU flash op as their block kernel, the op ringseq's
``backend="sdpa"`` calls, so the two ring engines are compared with the same block kernel.
"""
