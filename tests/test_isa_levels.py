"""The numeric tests at the machine's other ISA levels, as a CPU of that level would run them.

``python -m pytest -q`` runs every test at the CPU's best level. Users' CPUs differ: an AVX2
CPU runs ringseq's AVX2 kernel AND torch's AVX2 kernels (ATen's vectorized ops, oneDNN, MKL),
which compute the plain same-dtype reference the tolerance rule scales with
(docs/design.md); a test that passes at AVX-512 can miss its bound there (issue 25: a plugin
parity test failed on a Zen 3). So for every lower level this machine runs, the numeric test
modules below run again in a child pytest with ``RINGSEQ_CPU_ISA=<level>`` (ringseq's kernel)
and ``ATEN_CPU_CAPABILITY=<level>`` (torch's; read once when torch loads, hence a child
process), its progress dots streamed as they come.

Which modules: those whose results depend on the kernels' arithmetic: single-device kernels
and API, the ring in every layout, masks and windows, the sequence-parallel modes, and
training parity through transformers and the plugin. At the baseline level (SSE2; x86-64
machines without AVX2 are rare, other architectures build the generic code as baseline) the
kernel tests only: the distributed ones run the same kernels. The kernel-level tests that
already loop over every level in-process (the ``isa`` fixture) run once per child, at its
level. Budget: the whole suite stays under 20 minutes on 2 cores (README).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ringseq.kernels.extension import cpu_isa_levels

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# ringseq's level -> torch's ATEN_CPU_CAPABILITY for the same instructions
ATEN_LEVEL = {"baseline": "default", "avx2": "avx2", "avx512": "avx512"}
MODULES = {
    "avx2": ["test_kernel_cpu.py", "test_cpu_accuracy.py", "test_ops.py", "test_ring.py",
             "test_masked_ring.py", "test_sp_modes.py", "test_transformers_integration.py",
             "test_plugin.py", "test_sp_plugin.py"],
    "baseline": ["test_kernel_cpu.py", "test_cpu_accuracy.py", "test_ops.py"],
}
NATIVE = cpu_isa_levels()[-1] if cpu_isa_levels() else None
OTHER_LEVELS = [lvl for lvl in cpu_isa_levels() if lvl != NATIVE and lvl in MODULES]


def test_levels_to_rerun_are_known():
    """Every level the build can run below the native one has a module list (a new level
    must be added here), and every listed module exists."""
    for level in cpu_isa_levels():
        assert level == NATIVE or level in MODULES, f"no re-run list for ISA level {level!r}"
    for mods in MODULES.values():
        for m in mods:
            assert os.path.exists(os.path.join(HERE, m)), m


@pytest.mark.skipif(not OTHER_LEVELS, reason="this machine runs only one ISA level "
                    "(the suite itself ran at it)")
@pytest.mark.parametrize("level", OTHER_LEVELS)
def test_numeric_modules_at_other_isa_level(level, capsys):
    env = dict(os.environ, RINGSEQ_CPU_ISA=level, ATEN_CPU_CAPABILITY=ATEN_LEVEL[level])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
           "addopts=-ra", *MODULES[level]]
    t0 = time.time()
    with capsys.disabled():
        sys.stdout.write(f"\n[{level} re-run: RINGSEQ_CPU_ISA={level} "
                         f"ATEN_CPU_CAPABILITY={ATEN_LEVEL[level]} pytest -q "
                         f"{' '.join(MODULES[level])}]\n")
        sys.stdout.flush()
        proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        out = []
        while True:  # stream the child's dots as they come (it prints no newline per test)
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            out.append(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        rc = proc.wait()
        sys.stdout.write(f"[{level} re-run: exit {rc} after {time.time() - t0:.0f} s]\n")
        sys.stdout.flush()
    text = b"".join(out).decode(errors="replace")
    assert rc == 0, f"the numeric tests fail at ISA level {level}:\n{text[-6000:]}"
    assert " passed" in text, text[-2000:]
