"""The CPU kernels' causal ranges (csrc/kernel_math.h, CPU section) against a brute-force mask.

tests/cpp/index_math_dump.cpp (mode cpu_ranges) prints the helpers' values; the expectations
here come from the definition (key j visible to query i iff j <= i + s_k - s_q), written
independently.
"""

import pytest


SHAPES = [(1, 1), (1, 9), (9, 1), (7, 7), (5, 12), (12, 5), (16, 16), (13, 29), (29, 13)]


def visible(i, j, s_q, s_k, causal):
    return 0 <= i < s_q and 0 <= j < s_k and (not causal or j <= i + s_k - s_q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SHAPES)
def test_cpu_causal_ranges(index_math_harness, s_q, s_k, causal):
    got = index_math_harness("cpu_ranges", s_q, s_k, int(causal))
    # kv_end(row_end): one past the last key any row < row_end sees (0 if none)
    for row_end, kv_end in enumerate(got["kv_end"]):
        if row_end == 0:
            continue  # defined for row_end >= 1
        seen = [j for i in range(row_end) for j in range(s_k) if visible(i, j, s_q, s_k, causal)]
        assert kv_end == (max(seen) + 1 if seen else 0), (row_end, kv_end)
        # row_end - 1 sees every key before kv_end (a prefix), and no row < row_end sees more
        assert all(visible(row_end - 1, j, s_q, s_k, causal) for j in range(kv_end))
    # first_row(key): the first row that sees key (s_q if none), for keys in and out of range
    for key, first in zip(range(-2, s_k + 2), got["first_row"]):
        if 0 <= key < s_k:
            rows = [i for i in range(s_q) if visible(i, key, s_q, s_k, causal)]
            assert first == (rows[0] if rows else s_q), (key, first)
            assert rows == list(range(first, s_q))  # and every later row sees it
        assert 0 <= first <= s_q
    # masked(row0, key_end): some key < key_end is hidden from row0 (rows after row0 see more)
    for row0, key_end, masked in got["masked"]:
        hidden = any(not visible(row0, j, s_q, s_k, causal) for j in range(key_end))
        assert bool(masked) == hidden, (row0, key_end)
