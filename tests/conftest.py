"""Fixtures shared by the test files."""
from __future__ import annotations

import os

import pytest

from utils import cpu_isa_forced, isa_levels


@pytest.fixture(params=isa_levels())
def isa(request):
    """Runs the test with RINGSEQ_CPU_ISA=<level> for every ISA level this CPU and build run
    (none when ringseq._C is not built; only the forced one under RINGSEQ_CPU_ISA); the cached
    choice is dropped before and after, so the next kernel call reads the variable."""
    with cpu_isa_forced(request.param):
        yield request.param


@pytest.fixture(scope="session")
def index_math_harness(tmp_path_factory):
    """tests/cpp/index_math_dump.cpp (csrc/kernel_math.h's helpers) compiled once per session;
    a callable ``run(*args, stdin=None, json_out=True)`` returning the harness' parsed JSON (or
    its stdout). Skips when no host C++ compiler exists."""
    import json
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler: cannot build the index-math harness")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = str(tmp_path_factory.mktemp("index_math") / "index_math_dump")
    cmd = [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(root, "csrc"),
           os.path.join(root, "tests", "cpp", "index_math_dump.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"tests/cpp/index_math_dump.cpp does not compile:\n{proc.stderr}"

    def run(*args, stdin=None, json_out=True):
        out = subprocess.run([exe, *map(str, args)], input=stdin, capture_output=True, text=True)
        assert out.returncode == 0, f"index_math_dump {' '.join(map(str, args))}: {out.stderr}"
        return json.loads(out.stdout) if json_out else out.stdout

    return run
