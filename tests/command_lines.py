"""Many command lines of one benchmark script, run one after another in one child process.

A bad-argument case run as its own ``python script.py ...`` starts an interpreter and imports
torch (3-4 s on 2 cores; the suite has about ninety such cases). Here one child process runs
the script as ``__main__`` (``runpy``, as ``python script.py`` does) once per command line and
records, per command line, the exit status (``SystemExit`` as the interpreter turns it into one;
1 and the traceback on stderr for an uncaught exception), stdout and stderr.

    runs = run_command_lines(script_path, [["--repeats", "0"], ...], cwd=tmp_dir)
    runs[0].returncode, runs[0].stdout, runs[0].stderr

For command lines that stop in argument checking, which is what the tests batch: the cases
share the process's module state (a helper module's globals, warnings shown once), and what
processes a case starts print goes to the child's own output, not to the case's. A case that
does not finish within ``per_case`` seconds is stopped there (exit status 124, said on its
stderr) and the next one runs; if the child process dies, the cases it did not finish get
exit status -1 and the child's last output. One case never fails the others.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

_DRIVER = r"""
import contextlib, io, json, os, runpy, signal, sys, traceback
script, results_path, per_case = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.path.dirname(script))  # (as `python script.py` puts the script's folder)


class _Late(BaseException):
    pass


def _late(*_):
    raise _Late()


signal.signal(signal.SIGALRM, _late)
with open(results_path, "w") as results:
    for args in json.loads(sys.stdin.read()):
        out, err = io.StringIO(), io.StringIO()
        sys.argv = [script, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            signal.alarm(per_case)
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:  # what the interpreter would exit with
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except _Late:
                print(f"command_lines: this command line did not finish within {per_case} s",
                      file=sys.stderr)
                code = 124
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                signal.alarm(0)
        results.write(json.dumps([code, out.getvalue(), err.getvalue()]) + "\n")
        results.flush()  # (a child that dies later keeps the cases it finished)
"""


@dataclasses.dataclass(frozen=True)
class CommandLineRun:
    """What one command line gave, as ``subprocess.run(..., capture_output=True)`` shows it."""

    returncode: int
    stdout: str
    stderr: str


def run_command_lines(script: str, arg_lists, cwd: str, per_case: int = 120) -> list:
    """One :class:`CommandLineRun` per list of arguments in ``arg_lists``, in order; the runs
    share one child process (in ``cwd``). Never raises for a case: see the module doc."""
    arg_lists = [list(a) for a in arg_lists]
    results_path = os.path.join(cwd, "command_lines.jsonl")
    try:
        proc = subprocess.run([sys.executable, "-c", _DRIVER, script, results_path, str(per_case)],
                              input=json.dumps(arg_lists), capture_output=True, text=True,
                              cwd=cwd, timeout=per_case * len(arg_lists) + 60)
        ended = f"exit status {proc.returncode}; its output: {proc.stdout[-1500:]}" \
                f"{proc.stderr[-1500:]}"
    except subprocess.TimeoutExpired as exc:
        ended = f"killed after {exc.timeout} s"
    runs = []
    if os.path.exists(results_path):
        with open(results_path) as f:
            runs = [CommandLineRun(*json.loads(line)) for line in f if line.strip()]
    missing = CommandLineRun(-1, "", f"command_lines: the child process running the batch "
                                     f"ended before this command line finished ({ended})")
    return runs + [missing] * (len(arg_lists) - len(runs))
