"""The multi-rank helper of the tests and the benchmarks (not part of the library): spawn W
local gloo ranks on loopback, run a module-level function on each, collect the results, never
hang. Benchmarks import it from here (benchmarks/common.py puts tests/ on the path).

    results = run_ranks(fn, world_size, *args, timeout=120, threads=1, **kwargs)

``fn(*args, **kwargs)`` runs on every rank after ``init_process_group("gloo")`` (``pg_backend``
names another backend string, None none: torchrun scripts' ``init_process_group()``; rank and
world size come from ``torch.distributed``); its return value (anything ``torch.save`` can store)
comes back in a list indexed by rank. If a rank raises, ``RankError`` is raised here with that
rank's formatted traceback; ranks that are then stuck waiting for it are killed after a short
grace period. On ``timeout`` every rank is killed and ``RankTimeout`` raised.

Ranks are forked from a server process (multiprocessing's "forkserver") that imported torch,
ringseq and, where the caller has imported it, transformers once: a 4-rank call starts in
~0.2 s instead of the ~7 s that importing them again in every process ("spawn") cost on 2
cores, minutes over the suite. A rank is prepared like a fresh interpreter: the caller's
``sys.path`` and main module (so ``fn`` may live in a test or benchmark module that is not a
package) and the caller's environment at the call, plus ``env``. Variables that torch,
ringseq or transformers read when imported (_IMPORT_TIME: ``RINGSEQ_DEBUG_CHECKS``,
``ATEN_CPU_CAPABILITY``, ``TORCH*``, ``OMP_*``, ...) are the server's, so a call whose
environment differs from the server's in any of them spawns its ranks instead. The server
imports modules and runs no torch operation, so no thread pool exists when a rank is forked.
A call passes at most ~250 tensors in ``args`` (each takes a file descriptor; the server
refuses more).
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_FORKSERVER = mp.get_context("forkserver")
_SPAWN = mp.get_context("spawn")
# The modules every rank needs, for the fork server to import once: the optional ones only
# where the caller imported them (the server dies on an import error other than ImportError,
# which would fail every call).
_PRELOAD = ["torch", "torch.distributed", "ringseq"]
_PRELOAD_IF_IMPORTED = ["transformers", "transformers.modeling_utils"]
# Environment variables read at import time (by torch, its libraries, ringseq).
_IMPORT_TIME = ("RINGSEQ_DEBUG_CHECKS", "ATEN_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                "GOMP_", "DNNL_", "ONEDNN_", "CUDA_", "HF_", "TRANSFORMERS_")
_server_env = None  # _IMPORT_TIME variables the fork server started with (None: not started)


def _import_time_vars(env):
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME)}


def _context(env):
    """The fork server (started on first use with the caller's sys.path), or spawn where
    `env` differs from the server's environment in a variable read at import time."""
    global _server_env
    import multiprocessing.forkserver as forkserver
    import sys

    if _server_env is None:
        preload = _PRELOAD + [m for m in _PRELOAD_IF_IMPORTED if m in sys.modules]
        _FORKSERVER.set_forkserver_preload(preload)
        # Python 3.11's server ignores the caller's sys.path: give it through PYTHONPATH, so
        # that it imports the same ringseq the caller would.
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _server_env = _import_time_vars(os.environ)
    return _FORKSERVER if _import_time_vars(env) == _server_env else _SPAWN


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class RankTimeout(RuntimeError):
    """Ranks did not finish in time (all were killed)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, out_path, fn, args, kwargs, env, pg_timeout_s, threads,
            pg_backend):
    # the parent's environment at the call (plus ``env``), not the fork server's
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
    result = {"rank": rank}
    try:
        dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            result["value"] = fn(*args, **kwargs)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed rank may leave the group broken
                pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        result["time"] = time.time()
    tmp = out_path + ".tmp"
    torch.save(result, tmp)
    os.replace(tmp, out_path)


def run_ranks(fn, world_size, *args, timeout=120.0, env=None, grace=10.0, threads=1,
              pg_backend="gloo", **kwargs):
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` spawned gloo ranks with ``threads`` torch
    threads each and ``env`` added to their environment; returns the list of per-rank return
    values. Raises RankError (a rank raised or died) or RankTimeout (see the module docstring).
    """
    port = free_port()
    env = {**os.environ, **(env or {})}
    ctx = _context(env)
    with tempfile.TemporaryDirectory(prefix="ringseq_ranks_") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, port, paths[r], fn, args, kwargs, env,
                                   max(5.0, timeout), threads, pg_backend),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure_at = None
        inspected = set()
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise RankTimeout(f"{fn.__name__} on {world_size} ranks did not finish within "
                                      f"{timeout:.0f} s; ranks still running: "
                                      f"{[r for r, p in enumerate(procs) if p.is_alive()]}")
                for r, p in enumerate(procs):
                    if r not in inspected and not p.is_alive():
                        inspected.add(r)
                        if first_failure_at is None and (p.exitcode != 0 or _failed(paths[r])):
                            first_failure_at = now
                if first_failure_at is not None and now - first_failure_at > grace:
                    break  # the rest are waiting for a dead or failed peer
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        results = []
        for r, p in enumerate(procs):
            if not os.path.exists(paths[r]):
                results.append({"rank": r, "error": f"rank {r} exited with code {p.exitcode} "
                                                    f"without a result (killed or crashed)",
                                "traceback": ""})
            else:
                results.append(torch.load(paths[r], weights_only=False))
    errors = [res for res in results if "error" in res]
    if errors:
        # The earliest failure is the cause; later ones are usually peers losing it.
        real = [e for e in errors if e["traceback"]] or errors
        e = min(real, key=lambda e: e.get("time", float("inf")))
        summary = "\n".join(f"  rank {x['rank']}: {x['error'].splitlines()[0][:300]}"
                            for x in errors)
        raise RankError(f"rank {e['rank']} of {world_size} failed first: {e['error']}\n"
                        f"{e['traceback']}\nall failures:\n{summary}")
    return [res["value"] for res in results]


def _failed(path) -> bool:
    if not os.path.exists(path):
        return False
    try:
        return "error" in torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - being written
        return False
