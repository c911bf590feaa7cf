"""CPU tests of the KV-cache helpers of csrc/kernel_math.h (split-KV decoding).

tests/cpp/index_math_dump.cpp dumps km::kvcache_span (the span of one batch row of a KV-cache
call, for the int (CUDA) and int64_t (CPU) instantiations) and km::kv_splits /
km::split_blocks (how a call's keys are split). They are checked here against flash-attn's
definition of the visible keys written out element by element, not against the C++.
"""
import itertools

import numpy as np
import pytest


@pytest.fixture(scope="module")
def harness(index_math_harness):
    return index_math_harness


def flash_visible(q_len, leftpad, seqlen, causal, left, right, heads_as_rows, capacity):
    """(q_len, capacity) bool: flash_attn_with_kvcache's keys per query row. The valid keys are
    cache positions [leftpad, seqlen); masks are bottom-right aligned to them. heads_as_rows:
    the rows are heads of ONE query at the last position."""
    c = np.arange(capacity)[None, :]
    j = c - leftpad
    k_len = seqlen - leftpad
    i = np.zeros((q_len, 1), dtype=int) if heads_as_rows else np.arange(q_len)[:, None]
    sq = 1 if heads_as_rows else q_len
    off = k_len - sq
    vis = (c >= leftpad) & (c < seqlen)
    if causal:
        vis = vis & (j <= i + off)
    if left >= 0:
        vis = vis & (j >= i + off - left)
    if right >= 0:
        vis = vis & (j <= i + off + right)
    return np.broadcast_to(vis, (q_len, capacity))


def span_visible(span, q_len, capacity):
    k_start, k_len, lo, hi = span
    c = np.arange(capacity)[None, :]
    i = np.arange(q_len)[:, None]
    rel = (c - k_start) - i
    return (c >= k_start) & (c < k_start + k_len) & (rel >= lo) & (rel <= hi)


def kvcache_cases():
    capacity = 40
    for q_len, seqlen, leftpad in itertools.product((1, 2, 5, 17), (0, 1, 7, 23, 40), (0, 3, 7)):
        if leftpad > seqlen:
            continue
        for causal, (left, right), rows in itertools.product(
                (False, True), ((-1, -1), (0, 0), (3, -1), (-1, 2), (5, 1), (39, 39), (100, 0)),
                (False, True)):
            yield (q_len, leftpad, seqlen, int(causal), left, right, int(rows)), capacity


@pytest.mark.parametrize("mode", ["kvcache32", "kvcache64"])
def test_kvcache_span_sees_exactly_flash_attn_keys(harness, mode):
    cases = list(kvcache_cases())
    out = harness(mode, stdin="\n".join(" ".join(map(str, c)) for c, _ in cases) + "\n",
                  json_out=False).split("\n")
    for (case, capacity), line in zip(cases, out):
        q_len, leftpad, seqlen, causal, left, right, rows = case
        span = tuple(int(x) for x in line.split())
        k_start, k_len, lo, hi = span
        # the band comes clamped into [-q_len, k_len] (what the kernels' index sums rely on)
        assert -q_len <= lo <= hi <= max(k_len, -q_len) or k_len == 0, (case, span)
        assert 0 <= k_start and k_start + k_len <= max(seqlen, 0), (case, span)
        want = flash_visible(q_len, leftpad, seqlen, causal, left, right, rows, capacity)
        got = span_visible(span, q_len, capacity)
        assert np.array_equal(got, want), (case, span)


def split_cases():
    for req, q_tiles, items, key_tiles in itertools.product(
            (0, 1, 2, 3, 7, 500), (1, 2), (1, 3, 8, 63, 64, 300), (0, 1, 2, 3, 5, 64, 511)):
        for target, min_tiles, most in ((64, 2, 128), (264, 1, 128), (264, 1, 4)):
            yield req, q_tiles, items, key_tiles, target, min_tiles, most


def test_kv_splits_follow_the_rule_and_cover_every_key_tile_once(harness):
    cases = list(split_cases())
    lines = harness("splits", stdin="\n".join(" ".join(map(str, c)) for c in cases) + "\n",
                    json_out=False).strip().split("\n")
    for case, line in zip(cases, lines):
        req, q_tiles, items, key_tiles, target, min_tiles, most = case
        vals = [int(x) for x in line.split()]
        n, ranges = vals[0], list(zip(vals[1::2], vals[2::2]))
        if req > 0:  # asked for: honoured up to one split per key tile (and the maximum)
            want = max(1, min(req, key_tiles, most))
        elif q_tiles != 1 or items >= target or key_tiles < 2 * min_tiles:
            want = 1  # prefill-like calls, enough items, or too few keys: no split
        else:
            want = max(1, min(-(-target // items), key_tiles // min_tiles, most))
        assert n == want, (case, n)
        assert len(ranges) == n
        # consecutive ranges covering [0, key_tiles) once, none longer than ceil(tiles / n)
        assert ranges[0][0] == 0 and ranges[-1][1] == key_tiles, (case, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (case, ranges)
        assert all(0 <= e - b <= -(-key_tiles // n) for b, e in ranges), (case, ranges)
