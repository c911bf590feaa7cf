"""The README runs as written.

Every ```python block of README.md runs as a script in a fresh interpreter, in a scratch
folder. A block right after a ``<!-- example: ranks=N -->`` line runs as N processes with the
environment ``torchrun --nproc-per-node N`` gives (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so its ``dist.init_process_group(...)`` works as
under torchrun; without a GPU the blocks choose gloo and the CPU themselves (a block that
needs a GPU must choose its device so, as the ring example does). The README's two commands
are the ones .ci/run runs, and ``ringseq.__version__`` is the installed package's version.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKER = re.compile(r"^<!-- example: ranks=(\d+) -->$")


@dataclass(frozen=True)
class Block:
    line: int   # 1-based line of the opening fence
    code: str
    ranks: int  # 0: one plain process, no torchrun environment


def readme_blocks(kind="python"):
    """(line, code, ranks) of every ```kind block of README.md."""
    lines = open(README).read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{kind}":
            marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append(Block(i + 1, "\n".join(lines[i + 1:end]) + "\n",
                                int(marker.group(1)) if marker else 0))
            i = end
        i += 1
    return blocks


PYTHON_BLOCKS = readme_blocks()


def _run(block, tmp_path, timeout=600):
    """Runs the block as a script on block.ranks processes (1 when 0); returns [(rc, output)]."""
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(block.code)
    n = max(1, block.ranks)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    port = str(free_port())
    procs = []
    for rank in range(n):
        penv = dict(env)
        if block.ranks:
            penv.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                        LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=penv,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def test_every_python_block_is_found():
    # the examples this file promises to run: ring attention, drop-in, transformers, packed
    # documents, Booster, sequence-parallel modes, single device
    assert len(PYTHON_BLOCKS) >= 7, [b.line for b in PYTHON_BLOCKS]
    for b in PYTHON_BLOCKS:
        uses_group = "init_process_group" in b.code
        assert bool(b.ranks) == uses_group, (
            f"README.md line {b.line}: a block that creates a process group needs an "
            f"'<!-- example: ranks=N -->' line before it, and only such a block")
        # torch asks for it: a gloo group left to interpreter finalization can abort the
        # process after a run that succeeded
        assert not uses_group or "dist.destroy_process_group()" in b.code, (
            f"README.md line {b.line}: a block that creates a process group destroys it")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: f"line{b.line}")
def test_readme_python_block_runs_as_written(block, tmp_path):
    pytest.importorskip("transformers") if "transformers" in block.code else None
    for rank, (rc, out) in enumerate(_run(block, tmp_path)):
        assert rc == 0, (f"README.md line {block.line} failed on rank {rank} of "
                         f"{max(1, block.ranks)} (exit {rc}):\n{out[-4000:]}")
        assert "Failed to initialize NumPy" not in out, out[-2000:]


def _commands(text):
    """Shell lines starting with `pip install` (the README's install-and-run commands)."""
    return [line.strip() for line in text.splitlines() if line.strip().startswith("pip install torch")]


def test_ci_runs_the_readme_commands_verbatim():
    readme = [c for b in readme_blocks("bash") for c in _commands(b.code)]
    ci = _commands(open(os.path.join(ROOT, ".ci", "run")).read())
    main_job = next(c for c in readme if c.endswith("python benchmarks/bench_ring.py"))
    tests = next(c for c in readme if c.endswith("python -m pytest -q"))
    assert tests in ci, "the README's test command is not in .ci/run"
    install = main_job[:-len(" && python benchmarks/bench_ring.py")]
    assert install in ci, "the README's main-job install command is not in .ci/run"


def test_one_version_number():
    """setup.py takes the package version from ringseq/__init__.py (``python setup.py
    --version`` asks it without building anything)."""
    import ringseq
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, RINGSEQ_CUDA="0"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == ringseq.__version__, proc.stdout


def test_a_setuptools_that_cannot_build_wheels_stops_with_what_to_do():
    """pip builds through setuptools' bdist_wheel: setuptools < 70.1 without the wheel package
    (Python 3.11's venv with torch <= 2.12) stopped with a bare "invalid command
    'bdist_wheel'"; now setup.py says to upgrade setuptools. The missing modules are hidden by
    None entries in sys.modules, which make every import of them fail."""
    probe = ("import runpy, sys\n"
             "for name in ('setuptools.command.bdist_wheel', 'wheel', 'wheel.bdist_wheel'):\n"
             "    sys.modules[name] = None\n"
             "sys.argv = ['setup.py', 'dist_info', '--output-dir', 'unused']\n"
             "runpy.run_path('setup.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, RINGSEQ_CUDA="0"), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ringseq build error: setuptools " in proc.stderr, proc.stderr
    assert "cannot build wheels (it needs setuptools >= 70.1 or the wheel package" in proc.stderr
    assert "`pip install -U setuptools`" in proc.stderr and "Traceback" not in proc.stderr


def test_a_build_without_torch_or_a_compiler_says_which_and_what_to_do(tmp_path):
    """torch hidden (pip's isolated build does not see the installed one): the message names
    the isolation and --no-build-isolation (before: "torch must be installed", which it was).
    No compiler (CXX names none on PATH): one message at the build's start, and metadata still
    answers (before: every ISA level "rejected", then ninja's "c++: not found" in a long log
    with tracebacks)."""
    hidden = ("import runpy, sys\n"
              "sys.modules['torch'] = None\n"
              "sys.argv = ['setup.py', '--version']\n"
              "runpy.run_path('setup.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", hidden], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, RINGSEQ_CUDA="0"), timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "ringseq build error: torch cannot be imported where ringseq is being built" in \
        proc.stderr and "`pip install --no-build-isolation -e .`" in proc.stderr, proc.stderr
    env = dict(os.environ, RINGSEQ_CUDA="0", CXX=str(tmp_path / "no-such-c++"))
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "rejects" not in proc.stdout, proc.stdout + proc.stderr
    build = str(tmp_path / "build")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", build,
                           "--build-lib", build], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"ringseq build error: no C++ compiler: '{tmp_path / 'no-such-c++'}'" in \
        proc.stderr, proc.stderr


def test_a_package_without_its_extension_says_where_and_how_to_build_it():
    """Without ringseq/_C*.so (a checkout never built, or one shadowing an installed ringseq)
    the Python backends run, and backend='ringseq' names the folder and the build (before:
    Python's "partially initialized module ... circular import")."""
    probe = ("import sys\n"
             "sys.modules['ringseq._C'] = None\n"
             "import torch, ringseq\n"
             "q = torch.randn(1, 8, 2, 16)\n"
             "assert ringseq.flash_attn_func(q, q, q).shape == q.shape\n"
             "ringseq.flash_attn_func(q, q, q, backend='ringseq')\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ringseq._C is not built: " + os.path.join(ROOT, "ringseq") + " has no compiled " \
           "ringseq/_C*.so (build it there with `pip install --no-build-isolation -e .`" in \
        proc.stderr, proc.stderr


def test_import_without_numpy_is_quiet():
    """Without NumPy, `import torch` warns "Failed to initialize NumPy"; `import ringseq`
    must not (the main job's install has no NumPy). NumPy is hidden by a None entry in
    sys.modules, which makes every import of it fail."""
    hide = "import sys; sys.modules['numpy'] = None; "
    torch_alone = subprocess.run([sys.executable, "-c", hide + "import torch"],
                                 capture_output=True, text=True)
    assert "Failed to initialize NumPy" in torch_alone.stderr  # the condition is reproduced
    ours = subprocess.run([sys.executable, "-c", hide + "import ringseq, warnings; "
                           "assert not any('NumPy' in str(f[1]) for f in warnings.filters)"],
                          capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr
    assert "NumPy" not in ours.stderr, ours.stderr
