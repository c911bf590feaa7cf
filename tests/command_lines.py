"""Many command lines of one benchmark script, run one after another in one child process.

A bad-argument case run as its own ``python script.py ...`` starts an interpreter and imports
torch (3-4 s on 2 cores; the suite has about ninety such cases). Here one child process runs
the script as ``__main__`` (``runpy``, as ``python script.py`` does) once per command line and
records what a process of its own would have shown: the exit status (``SystemExit`` as the
interpreter turns it into one; 1 and the traceback on stderr for an uncaught exception),
stdout and stderr.

    runs = run_command_lines(script_path, [["--repeats", "0"], ...], cwd=tmp_dir)
    runs[0].returncode, runs[0].stdout, runs[0].stderr
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
script, results_path = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(script))  # (as `python script.py` puts the script's folder)
results = []
for args in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:  # what the interpreter would exit with
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
with open(results_path, "w") as f:
    json.dump(results, f)
"""


@dataclasses.dataclass(frozen=True)
class CommandLineRun:
    """What one command line gave, as ``subprocess.run(..., capture_output=True)`` shows it."""

    returncode: int
    stdout: str
    stderr: str


def run_command_lines(script: str, arg_lists, cwd: str, timeout: float = 600) -> list:
    """One :class:`CommandLineRun` per list of arguments in ``arg_lists``, in order; the runs
    share one child process (in ``cwd``). AssertionError if the child itself fails."""
    results_path = os.path.join(cwd, "command_lines.json")
    proc = subprocess.run([sys.executable, "-c", _DRIVER, script, results_path],
                          input=json.dumps([list(a) for a in arg_lists]), capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0 and os.path.exists(results_path), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(results_path) as f:
        return [CommandLineRun(*r) for r in json.load(f)]
