"""The one helper that runs a function on N gloo ranks, wired exactly like torchrun.

    results = launch(my_worker, world_size=4, args=(path, tensor))  # [result of rank 0, ..., rank 3]

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>) before the worker runs, so the worker calls
`torchspec.distributed.init_distributed()` just like a recipe does. The worker must be a
module-level function; its args and return value are pickled (tensors are fine).

A rank that raises fails the test with THAT rank's traceback (the others, likely stuck in a
collective, are killed after a short grace period); a run past `timeout_s` fails with the ranks
still running and the tail of their output. Each rank uses one CPU thread (CI has 2 cores).

Speed: ranks are forked from a multiprocessing *forkserver* -- a fresh interpreter, started once
per test session, that imports `PRELOAD` (torch, transformers, ...) once. Importing those costs
~4 s of CPU per process, which would otherwise dominate every launch. The server never runs a
torch op or creates a process group, so each forked rank starts as clean as a spawned one.
Tests that need another heavy module (e.g. deepspeed) may add it to `PRELOAD`. Ranks inherit
the environment the server started with (this process's at the first launch): pass anything set
later (e.g. by monkeypatch.setenv) through ``env=``.

Scripts (recipes) go through the same server: ``run_script(script, argv, nproc, env)`` is
``python script argv`` (nproc 1) or ``torchrun --nproc_per_node=nproc script argv`` with the exit
status, stdout and stderr of ``subprocess.run`` -- minus the import of torch + transformers + torchspec
(~5 s of CPU) in every process. The script runs as ``__main__`` with its own folder first on
``sys.path`` and exactly ``env`` as its environment, like a fresh interpreter.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

# recipes.train (all of torchspec), hydra (its compose API) and matplotlib (the run's plot): what run_script's
# recipes import on top of the ranks' modules.
PRELOAD = ["torch", "torch.distributed.tensor", "transformers", "torchspec.targets", "recipes.train",
           "hydra", "hydra.core.override_parser.overrides_parser", "matplotlib", "matplotlib.figure"]
GRACE_S = 2.0  # after the first failure, how long the other ranks get to report their own errors


class DistributedTestFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first launch)
    return ctx


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1; return their results in rank order."""
    assert "<locals>" not in fn.__qualname__, f"{fn.__qualname__} must be a module-level function"
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="torchspec-launch-") as work:
        with open(os.path.join(work, "payload.pkl"), "wb") as f:
            pickle.dump((fn.__module__, fn.__qualname__, args), f)
        base_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            **(env or {}),
        }
        procs = []
        for rank in range(world_size):
            rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = ctx.Process(target=_child_main, args=(work, rank_env), name=f"rank{rank}", daemon=True)
            proc.start()
            procs.append(proc)
        try:
            _wait(procs, timeout_s, work, fn.__qualname__)
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
        results = []
        for rank in range(world_size):
            with open(os.path.join(work, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _wait(procs: list, timeout_s: float, work: str, name: str) -> None:
    start = time.monotonic()
    first_failure, first_failed = None, []
    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        now = time.monotonic()
        if failed and first_failure is None:
            first_failure, first_failed = now, failed
        if first_failure is not None and (all(c is not None for c in codes) or now - first_failure > GRACE_S):
            raise DistributedTestFailure(_failure_report(procs, work, name, first_failed))
        if now - start > timeout_s:
            running = [r for r, c in enumerate(codes) if c is None]
            raise DistributedTestFailure(
                f"{name} on {len(procs)} ranks timed out after {timeout_s:.0f}s; ranks still running: {running} "
                "(a collective some rank never joined?)\n" + _tails(work, running)
            )
        time.sleep(0.02)


def _failure_report(procs: list, work: str, name: str, first_failed: list[int]) -> str:
    parts = [f"first to fail: rank(s) {first_failed} (errors on other ranks may be consequences)"]
    for rank, proc in enumerate(procs):
        err = os.path.join(work, f"error{rank}.txt")
        if os.path.exists(err):
            with open(err) as f:
                parts.append(f"--- rank {rank} raised:\n{f.read()}")
        elif proc.exitcode not in (None, 0):
            parts.append(f"--- rank {rank} exited with code {proc.exitcode}:\n{_tails(work, [rank])}")
    still = [r for r, p in enumerate(procs) if p.exitcode is None]
    if still:
        parts.append(f"--- ranks {still} were still running and are killed")
    return f"{name} failed on {len(procs)} ranks:\n" + "\n".join(parts)


def _tails(work: str, ranks: list[int], chars: int = 3000) -> str:
    out = []
    for rank in ranks:
        path = os.path.join(work, f"rank{rank}.log")
        text = open(path, "rb").read().decode(errors="replace") if os.path.exists(path) else ""
        out.append(f"[rank {rank} output, last {chars} chars]\n{text[-chars:]}")
    return "\n".join(out)


def _child_main(work: str, env: dict[str, str]) -> None:
    rank = int(env["RANK"])
    log = os.open(os.path.join(work, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        with open(os.path.join(work, "payload.pkl"), "rb") as f:
            module, qualname, args = pickle.load(f)
        fn = importlib.import_module(module)
        for attr in qualname.split("."):
            fn = getattr(fn, attr)
        result = fn(*args)
        with open(os.path.join(work, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except BaseException:
        with open(os.path.join(work, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)  # no atexit/teardown: a peer may be stuck, and the parent reads error{rank}.txt


# --- scripts: python / torchrun, forked from the server ------------------------------------------------


def run_script(script: str | os.PathLike, argv: list[str], nproc: int = 1, env: dict[str, str] | None = None,
               timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """``python script *argv`` (nproc 1) or ``torchrun --nproc_per_node=nproc script *argv``: its exit status
    (torchrun's: 1 if any rank failed), stdout and stderr (the ranks' in rank order). ``env``: the whole
    environment (default: this process's). A rank that fails stops the others after ``GRACE_S``, as torchrun
    does; past ``timeout_s`` every rank is killed and ``subprocess.TimeoutExpired`` raised."""
    ctx, script = _context(), os.path.abspath(script)
    env = dict(os.environ if env is None else env)
    if nproc > 1:  # what torchrun's agent gives each worker
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                    "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"})
        env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="torchspec-script-") as work:
        procs = []
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)} if nproc > 1 else env
            proc = ctx.Process(target=_script_main, args=(work, rank, script, list(argv), rank_env, os.getcwd()),
                               name=f"rank{rank}", daemon=True)
            proc.start()
            procs.append(proc)
        start, first_failure = time.monotonic(), None
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                    first_failure = now
                if now - start > timeout_s:
                    raise subprocess.TimeoutExpired([script, *argv], timeout_s)
                if first_failure is not None and now - first_failure > GRACE_S:
                    break
                time.sleep(0.02)
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
        codes = [proc.exitcode for proc in procs]
        code = codes[0] if nproc == 1 else int(any(codes))

        def read(name: str) -> str:  # a rank killed before it opened its files printed nothing
            paths = [os.path.join(work, f"{name}{rank}") for rank in range(nproc)]
            return "".join(open(p, "rb").read().decode(errors="replace") for p in paths if os.path.exists(p))
        return subprocess.CompletedProcess([script, *argv], code, read("stdout"), read("stderr"))


def _script_main(work: str, rank: int, script: str, argv: list[str], env: dict[str, str], cwd: str) -> None:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        opened = os.open(os.path.join(work, f"{name}{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)  # the caller's, as a subprocess would inherit it (the server's may differ)
    os.environ.clear()
    os.environ.update(env)
    import torch

    if "OMP_NUM_THREADS" in env:  # read at torch's import in a fresh interpreter: the server imported it already
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise  # multiprocessing turns it into the exit status, as the interpreter does
    except BaseException:
        traceback.print_exc()  # the interpreter's report (multiprocessing would add a "Process rank0:" line)
        raise SystemExit(1) from None
