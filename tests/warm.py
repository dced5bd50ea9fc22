"""Flower's per-message processes, forked from one that has imported torch and peft once.

In a deployment, a SuperNode's SuperExec starts one ``flwr-clientapp`` process per
message (``flwr-serverapp`` per run on the SuperLink's side), each importing torch,
transformers and peft before it does anything: about 12 CPU-seconds on the 2-core CI
machine, most of what a deployment test costs. Flower's SuperExec starts them by name
(``subprocess.Popen(["flwr-clientapp", ...])``), so a test can put this file first on
the ``PATH`` under those names (:func:`install`). Run as ``flwr-clientapp`` it is a shim:
it hands its arguments, environment, working directory and standard streams to a warm
server (:func:`serve`, one per test) over a Unix socket and exits with the code of the
process the server forked for it. That process runs Flower's own entry point
(``flwr.supernode.cli:flwr_clientapp`` or ``flwr.superlink.cli:flwr_serverapp``, their
console scripts' targets), so
everything after the imports is what a real process does: Flower's message pulling,
the app's loading from the installed FAB, its training, its reply.

Signals sent to the shim (SIGTERM, SIGINT) are passed on to the forked process. A SIGKILL
of the shim cannot be: the forked process then ends as every ``flwr-clientapp`` does when
its SuperExec is gone (Flower's parent-process monitor, ``--parent-pid``), and the server
kills whatever is left when it stops.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

SOCKET_VAR = "FEDEXLORA_TEST_WARM_SOCKET"
ENTRY = {
    "flwr-clientapp": ("flwr.supernode.cli", "flwr_clientapp"),
    "flwr-serverapp": ("flwr.superlink.cli", "flwr_serverapp"),
}
PRELOAD = [
    "torch",
    "transformers",
    "peft",
    "flwr.supernode.cli",
    "flwr.superlink.cli",
    "fedexlora.flower.client_app",
    "fedexlora.flower.server_app",
    "fedexlora.bridge.steps",
    "fedexlora.run.build",
    "fedexlora.run.client_step",
    "fedexlora.run.lifecycle",
]


def _send(sock: socket.socket, payload: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    header = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [header + data], fds)
    else:
        sock.sendall(header + data)


def _recv(sock: socket.socket, with_fds: bool = False):
    chunks, fds = b"", []
    while len(chunks) < 4:
        if with_fds and not fds:
            part, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        else:
            part = sock.recv(1 << 16)
        if not part:
            return None, fds
        chunks += part
    size = struct.unpack("!I", chunks[:4])[0]
    while len(chunks) < 4 + size:
        part = sock.recv(1 << 16)
        if not part:
            return None, fds
        chunks += part
    return json.loads(chunks[4 : 4 + size]), fds


# -- the shim ------------------------------------------------------------------------
def shim() -> None:
    name = Path(sys.argv[0]).name
    path = os.environ.get(SOCKET_VAR)
    if name not in ENTRY or not path:
        sys.exit(f"{name}: no warm server ({SOCKET_VAR} is not set)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = {"name": name, "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}
    _send(sock, request, fds=[0, 1, 2])
    started, _ = _recv(sock)
    if started is None:
        sys.exit(f"{name}: the warm server closed the connection")
    child = int(started["pid"])

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    done, _ = _recv(sock)
    sys.exit(1 if done is None else int(done["code"]))


# -- the server ----------------------------------------------------------------------
def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked process: become the requested command, run it, report its code."""
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    module, func = ENTRY[request["name"]]
    code = 0
    try:
        getattr(__import__(module, fromlist=[func]), func)()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what the interpreter prints before exiting with 1
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _send(conn, {"code": code})
    except OSError:
        pass
    os._exit(code)


def serve(path: str) -> None:
    """Imports :data:`PRELOAD`, then forks one process per shim connection."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # ready once the socket has its name
    while True:
        conn, _ = server.accept()
        request, fds = _recv(conn, with_fds=True)
        if request is None:
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            os.setpgid(0, 0)
            _child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass
        conn.close()  # the child holds its own copy


class WarmServer:
    """A warm server in a process of its own, and a ``bin`` folder of shims for PATH."""

    def __init__(self, root: Path, python: str = sys.executable, env: dict | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.socket = str(root / "warm.sock")
        self.bin = root / "bin"
        self.bin.mkdir(exist_ok=True)
        for name in ENTRY:
            shim_path = self.bin / name
            shim_path.write_text(
                f"#!{python}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                "import warm\nwarm.shim()\n"
            )
            shim_path.chmod(0o755)
        self.log = open(root / "warm.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [python, str(Path(__file__)), "serve", self.socket],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the shims first on PATH and the server's socket."""
        return {
            **env,
            "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
            SOCKET_VAR: self.socket,
        }

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "the warm server did not start: "
                    + (self.root / "warm.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stops the server and every process it forked (each in its own group)."""
        forked = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    forked.append(int(entry.name))
        for pid in forked:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.kill()
        self.proc.wait()
        self.log.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        shim()
