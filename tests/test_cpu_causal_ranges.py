"""The CPU kernels' causal ranges (csrc/kernel_math.h, CPU section) against a brute-force mask.

tests/cpp/cpu_ranges_dump.cpp prints the helpers' values; the expectations here come from the
definition (key j visible to query i iff j <= i + s_k - s_q), written independently.
"""
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found: cannot build the harness")

SHAPES = [(1, 1), (1, 9), (9, 1), (7, 7), (5, 12), (12, 5), (16, 16), (13, 29), (29, 13)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("cpu_ranges") / "cpu_ranges_dump")
    cmd = [GXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc"),
           os.path.join(ROOT, "tests", "cpp", "cpu_ranges_dump.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"harness does not compile:\n{proc.stderr}"
    return exe


def visible(i, j, s_q, s_k, causal):
    return 0 <= i < s_q and 0 <= j < s_k and (not causal or j <= i + s_k - s_q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SHAPES)
def test_cpu_causal_ranges(harness, s_q, s_k, causal):
    out = subprocess.run([harness, str(s_q), str(s_k), str(int(causal))], capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
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
