"""``python apps/finetune/main.py ARGS`` for the tests, without a new interpreter per run.

Each app run of the suite used to cost ~9 s of CPU before its first step: the launcher's imports
(torch, Hydra, transformers' tokenizer: ~3 s), and its forkserver's (torch, dynamo, deepshard: ~6 s),
which the workers fork from.  Here one runner process per pytest worker holds both: it imports what
the launcher imports and starts the forkserver once, then forks a child per run that executes
``main.py`` as ``__main__`` (``runpy``) with the run's argv, directory and environment; the child's
workers fork from the runner's server.  What a run computes is the same code on the same inputs;
what differs is only where the imports came from.

What the process itself is checked for (signals to the launcher, a SIGKILLed launcher's workers, memory
of the launcher) stays a real subprocess (``Popen`` in the test), and so does
a run whose ``env`` changes more than what the app reads while it runs (:data:`RUN_TIME_KEYS`: torch,
glibc, Python and our own ``DEEPSHARD_HOST_ADAM`` read theirs at import, in the runner).
``DEEPSHARD_TEST_RUNNER=0`` sends every run to a subprocess.

The output: the runner's standard output and error are two pipes that the server, and so every
worker, inherited; the runner copies what arrives on them into the current run's files (one run at a
time), in the order it was written, as ``capture_output`` would have read it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "apps/finetune/main.py"
_ENABLED = os.environ.get("DEEPSHARD_TEST_RUNNER", "1") != "0"
# environment variables read while the app runs, not at import: a run may change them and still share the runner
# (the runner is unbuffered, so PYTHONUNBUFFERED changes nothing it captures)
# (and inductor's: its cache dir, read at each compile, and the pointer offset it writes into any process that
# loads a compiled kernel, before loading; a run's child gets exactly the run's environment)
RUN_TIME_KEYS = ("DEEPSHARD_TEST_FAULT", "DEEPSHARD_FAULT_SAVE_STALL", "HYDRA_FULL_ERROR", "PYTHONUNBUFFERED",
                 "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def run_main(args: Sequence[str], *, cwd: Path, timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python main.py ARGS`` as ``subprocess.run(capture_output=True, text=True)`` returns it; through
    this pytest worker's runner unless ``env`` changes a variable read at import (not in :data:`RUN_TIME_KEYS`)."""
    return _run(["main", str(MAIN)], args, cwd=cwd, timeout=timeout, env=env)


def run_module(module: str, args: Sequence[str], *, cwd: Path, timeout: float = 600,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` (one of our tools), as :func:`run_main` runs ``main.py``."""
    return _run(["module", module], args, cwd=cwd, timeout=timeout, env=env)


def _changed(env: Mapping[str, str], base: Mapping[str, str]) -> set[str]:
    return {k for k in set(env) | set(base) if env.get(k) != base.get(k) and not k.startswith("PYTEST_")}


def _run(what: list[str], args: Sequence[str], *, cwd: Path, timeout: float,
         env: dict[str, str] | None) -> subprocess.CompletedProcess:
    env = dict(os.environ) if env is None else env
    base = _RUNNER.env if _RUNNER is not None else os.environ  # the environment the runner imported with
    changed = _changed(env, base)
    if drift := _changed(os.environ, base) - set(RUN_TIME_KEYS):
        warnings.warn(f"the app runner is bypassed for every run from here on: this process's environment changed "
                      f"{sorted(drift)} since the runner started (something left them behind)", stacklevel=3)
    if not _ENABLED or not changed <= set(RUN_TIME_KEYS) or not _LOCK.acquire(blocking=False):
        command = [sys.executable, *(["-m", what[1]] if what[0] == "module" else [what[1]]), *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    try:
        return _runner().run(what, [str(a) for a in args], cwd=Path(cwd), timeout=timeout, env=env)
    finally:
        _LOCK.release()


class _Runner:
    """The client's end: one request and one answer at a time, JSON lines over the runner's pipes."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready = self._answer(timeout=300)
        self.server_pid = int(ready["server"])

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the app runner exited with code {self.proc.wait()}")
        return json.loads(line)

    def run(self, what: list[str], args: list[str], *, cwd: Path, timeout: float,
            env: dict[str, str]) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="app-run-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"what": what, "args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            child = int(self._answer(timeout=60)["pid"])
            try:
                code = self._answer(timeout=timeout)["returncode"]
            except TimeoutError:
                self._kill_run(child)
                self._answer(timeout=60)
                raise subprocess.TimeoutExpired([what[1], *args], timeout, _read(out), _read(err)) from None
            return subprocess.CompletedProcess([sys.executable, what[1], *args], code, _read(out), _read(err))

    def _kill_run(self, child: int) -> None:
        """The run's launcher, then its workers (the server's children: one run at a time)."""
        import psutil

        for pid in [child] + [p.pid for p in psutil.Process(self.server_pid).children()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.proc.kill()  # its server, then the server's workers, end with it (parent-death signals)
        self.proc.wait()


def _read(path: Path) -> str:
    """The file as ``subprocess.run(text=True)`` reads a pipe: universal newlines (a progress bar's ``\\r`` too)."""
    text = path.read_bytes().decode("utf-8", errors="replace") if path.exists() else ""
    return text.replace("\r\n", "\n").replace("\r", "\n")


_LOCK = threading.Lock()
_RUNNER: _Runner | None = None
# started by -c, not as a script: a script's folder (tests/) would go on sys.path, where tests/kernels
# shadows the installed ``kernels`` (tests/test_no_shadowing.py)
SERVE = "from tests.app_runner import _serve; _serve()"


def _runner() -> _Runner:
    global _RUNNER
    if _RUNNER is None or _RUNNER.proc.poll() is not None:
        _RUNNER = _Runner()
        atexit.register(_RUNNER.close)
    return _RUNNER


# --- the runner process ---------------------------------------------------------------------------

def _serve() -> None:
    """Import what a launcher imports, start the workers' server, then run each request in a child."""
    from deepshard.launch.parent_death import die_with_parent

    die_with_parent(os.getppid())
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    out_r, err_r = _stdio_to_pipes()

    import hydra  # noqa: F401  what main.py and app.py import, so a child finds them loaded
    import torch._dynamo  # noqa: F401  the preflight's model on the meta device imports it (~1 s a run)
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401

    from deepshard.finetune import app
    from deepshard.finetune.config import ds_config  # noqa: F401
    from deepshard.finetune.data.tokenizer import tokenizer_modules
    from deepshard.finetune.recipe.assemble import WORKER_IMPORTS
    from deepshard.launch.local import start_worker_server
    from deepshard.launch.worker_server import server_pid

    preload = tokenizer_modules("any")
    for module in preload:  # the launcher checks the data with the tokenizer too (transformers: ~1 s a run)
        importlib.import_module(module)
    start_worker_server(app.train_worker, preload=[*preload, *WORKER_IMPORTS])
    gc.collect()  # what the imports left is settled: a run's own full collections (the launcher trims
    gc.freeze()  # its heap before launching) then walk the run's objects, not the runner's ~0.3 s of them
    _say(answers, server=server_pid())
    for line in requests:
        request = json.loads(line)
        _pump({out_r: None, err_r: None}, until=None)  # what a leftover wrote belongs to no run
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            for fd in (out_r, err_r):
                os.close(fd)
            _child(request)
        _say(answers, pid=pid)
        with open(request["stdout"], "wb") as out, open(request["stderr"], "wb") as err:
            status = _pump({out_r: out, err_r: err}, until=pid)
        _say(answers, returncode=os.waitstatus_to_exitcode(status))


def _stdio_to_pipes() -> tuple[int, int]:
    """Standard input from /dev/null; standard output and error into two pipes this process reads."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    ends = []
    for fd in (1, 2):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        ends.append(r)
    return ends[0], ends[1]


def _pump(sinks: dict, *, until: int | None) -> int:
    """Copy the pipes into their files until child ``until`` has exited and the pipes are quiet for
    0.2 s (its workers' last lines); without ``until``, until they are quiet."""
    status = 0
    done = until is None
    while True:
        ready, _, _ = select.select(list(sinks), [], [], 0.2 if done else 0.05)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if sinks[fd] is not None:
                sinks[fd].write(data)
        if not done:
            pid, status = os.waitpid(until, os.WNOHANG)
            done = pid != 0
        elif not ready:
            return status


def _child(request: dict) -> None:
    """Be ``python main.py ARGS`` (or ``python -m MODULE ARGS``) in ``cwd`` with ``env``, and end as the
    interpreter would (threads joined, exit handlers run, streams flushed); never returns."""
    import atexit as exit_handlers
    import runpy
    import traceback

    from deepshard.launch.parent_death import die_with_parent

    code: int | str | None = 1
    try:
        die_with_parent(os.getppid())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        kind, target = request["what"]
        sys.argv = [target, *request["args"]]
        _reuse_server()
        if kind == "main":
            sys.path[0] = str(Path(target).parent)  # as ``python main.py`` sets it
            runpy.run_path(target, run_name="__main__")  # main.py ends by os._exit
        else:
            sys.path[0] = os.getcwd()  # as ``python -m`` sets it
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()
        exit_handlers._run_exitfuncs()
    finally:
        if isinstance(code, str):  # sys.exit("message")
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _reuse_server() -> None:
    """multiprocessing checks its forkserver with ``waitpid``, which only its parent (the runner) may
    call; the child checks that it lives instead."""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver

    def ensure_running() -> None:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        os.kill(server._forkserver_pid, 0)

    server.ensure_running = ensure_running
    forkserver.ensure_running = ensure_running


def _say(stream, **answer) -> None:
    stream.write((json.dumps(answer) + "\n").encode())
    stream.flush()

