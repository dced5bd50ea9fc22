"""``fedexlora run`` in a real child process, without paying its imports each time.

The crash tests start the CLI many times and SIGKILL it. A fresh ``python -m fedexlora``
spends about 15 CPU-seconds importing torch, transformers and peft before it does
anything, and on the 2-core CI machine that start-up was most of those tests' time.

:func:`start` runs the same entry point (``fedexlora.cli.app``, what ``python -m
fedexlora`` calls) in a process forked from a multiprocessing *forkserver* that has
imported those libraries once. Each run is still its own process, with its own PID,
process group, environment, working files and exit code: SIGKILL ends it exactly as it
ends a fresh interpreter, and nothing it did survives in the server. The forkserver runs
no torch code, so its children start with no threads.

Tests that need the real console entry point itself (``python -m fedexlora``) keep
starting it with :func:`subprocess.Popen`; see ``test_cli.py``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import tempfile

PRELOAD = [
    "torch",
    "transformers",
    "peft",
    "fedexlora.cli",
    "fedexlora.run.inprocess",
    "fedexlora.bridge.adapters",
    "fedexlora.flower.simulation",
]

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _main(argv: list[str], env: dict[str, str], log: str, cwd: str | None) -> None:
    """The child: a process group of its own, the caller's environment, then the CLI."""
    os.setpgrp()  # like start_new_session: a kill of the group reaches all it starts
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    from fedexlora.cli import app

    code = 0
    try:
        app(argv, prog_name="fedexlora")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what the interpreter would print before exiting with 1
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a multiprocessing child skips them; an interpreter does not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Run:
    """A started ``fedexlora`` command: ``pid``, ``poll()``, ``wait()``, ``kill()``."""

    def __init__(self, proc, log: str):
        self.proc = proc
        self.pid = proc.pid
        self.log = log

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def output(self) -> str:
        if not os.path.exists(self.log):
            return ""
        with open(self.log, errors="replace") as f:
            return f.read()


def start(*args: str, env: dict[str, str] | None = None, log=None, cwd=None) -> Run:
    """Starts ``fedexlora ARGS`` in a forked child; its output goes to ``log``.

    Without ``log`` the output goes to a temporary file (read with ``Run.output()``).
    """
    if log is None:
        fd, log = tempfile.mkstemp(prefix="fedexlora-", suffix=".log")
        os.close(fd)
        atexit.register(_remove, log)  # a temporary log goes when the test process ends
    proc = _context().Process(
        target=_main,
        args=(list(args), dict(os.environ if env is None else env), str(log),
              None if cwd is None else str(cwd)),
        daemon=False,
    )  # fmt: skip
    proc.start()
    return Run(proc, str(log))


def run(*args: str, env=None, log=None, cwd=None, timeout: float | None = None):
    """Runs ``fedexlora ARGS`` to the end; returns ``(exit code, its output)``."""
    r = start(*args, env=env, log=log, cwd=cwd)
    code = r.wait(timeout)
    if code is None:
        os.killpg(r.pid, signal.SIGKILL)
        r.wait()
        raise TimeoutError(f"fedexlora {' '.join(args)} did not finish in {timeout}s")
    return code, r.output()
