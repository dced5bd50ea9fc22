"""A real Flower deployment on 127.0.0.1, and a SuperNode killed mid-run (integration).

``flower-superlink`` and two ``flower-supernode`` processes with TLS and SuperNode
authentication, self-signed credentials made here; every process is stopped by PID.
One federation serves two jobs: the crash scenario (the SuperLink, then a SuperNode
killed), then a job whose clients each train on two processes (a worker group, DDP on
gloo; the tests marked ``multiprocess``).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fedexlora.run.report import read_metrics
from fedexlora.run.restore import load_task_for, restore_model
from test_flower import ROOT, VENV_BIN, _final_model, _rel_diff, _state_dict_rel_diff

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=134)


# -- a real deployment on 127.0.0.1: SuperLink, two SuperNodes, TLS, node auth --------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_credentials(d: Path, num_nodes: int) -> None:
    """A self-signed CA, a server certificate for 127.0.0.1, one EC P-384 key per node."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def pem_key(key):
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedexlora test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(pem_key(key))
    for i in range(num_nodes):
        node_key = ec.generate_private_key(ec.SECP384R1())
        (d / f"supernode-{i}").write_bytes(
            node_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        (d / f"supernode-{i}.pub").write_bytes(
            node_key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(procs: list[subprocess.Popen], sig=signal.SIGTERM, wait: float = 15.0) -> None:
    """Stops each process we started and all its descendants, by PID."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid, *_descendants(p.pid)]  # collected before any of them dies
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for pid in pids:  # whatever is left (including reparented grandchildren)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Federation:
    """``flower-superlink`` (TLS, SuperNode auth) and SuperNodes on 127.0.0.1, by PID."""

    def __init__(self, root: Path, num_nodes: int = 2, database: Path | None = None):
        self.root = root
        self.num_nodes = num_nodes
        self.database = database  # None: the SuperLink's state lives in memory
        self.creds = root / "credentials"
        self.creds.mkdir(parents=True)
        _write_credentials(self.creds, num_nodes)
        self.port = _free_port()
        self.env = {
            **os.environ,
            "FLWR_HOME": str(root / "flwr-home"),
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        # The app as `flwr run` ships it: the repository's pyproject.toml, in a folder of
        # its own (Flower walks the app folder file by file, and a clone's .venv holds
        # about 75,000 files: 15 CPU-seconds of `flwr run` each time)
        self.app = root / "app"
        self.app.mkdir()
        (self.app / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
        (root / "flwr-home").mkdir()
        (root / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "fedexlora-test"\n\n[superlink.fedexlora-test]\n'
            f'address = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.creds / "ca.crt"}"\n'
        )
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}
        self.others: list[subprocess.Popen] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115
        return subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root
        )

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(VENV_BIN / "flwr"), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start_superlink(self, name: str = "superlink") -> None:
        import httpx

        c = self.creds
        db = ["--database", str(self.database)] if self.database else []
        self.superlink = self._spawn(
            name,
            [
                str(VENV_BIN / "flower-superlink"),
                "--host", "127.0.0.1",
                "--port", str(self.port),
                "--ssl-ca-certfile", str(c / "ca.crt"),
                "--ssl-certfile", str(c / "server.pem"),
                "--ssl-keyfile", str(c / "server.key"),
                "--enable-supernode-auth",
                *db,
            ],
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            assert self.superlink.poll() is None, self.log(name)
            try:
                if httpx.get(
                    f"https://127.0.0.1:{self.port}/health", verify=str(c / "ca.crt"), timeout=2
                ).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "SuperLink did not start\n" + self.log(name)
            time.sleep(0.5)

    def start_supernode(self, i: int) -> None:
        """``flower-supernode`` for partition ``i``."""
        c = self.creds
        self.supernodes[i] = self._spawn(
            f"supernode-{i}",
            [
                str(VENV_BIN / "flower-supernode"),
                "--superlink", f"127.0.0.1:{self.port}",
                "--root-certificates", str(c / "ca.crt"),
                "--auth-supernode-private-key", str(c / f"supernode-{i}"),
                "--node-config", f"partition-id={i} num-partitions={self.num_nodes}",
                "--port", str(_free_port()),
            ],
        )  # fmt: skip

    def start(self) -> "Federation":
        c = self.creds
        self.start_superlink()
        for i in range(self.num_nodes):
            res = self.flwr("supernode", "register", str(c / f"supernode-{i}.pub"))
            assert res.returncode == 0, res.stdout + res.stderr
        for i in range(self.num_nodes):
            self.start_supernode(i)
        return self

    def run(self, cfg, run_dir: Path, name: str = "flwr-run", **settings) -> subprocess.Popen:
        """``flwr run APP fedexlora-test --stream -c ...`` in the background."""
        from fedexlora.flower.records import to_run_config

        rc = to_run_config(cfg, run_dir=str(run_dir), min_train_nodes=1, **settings)
        pairs = " ".join(f"{k}={json.dumps(v)}" for k, v in rc.items())
        proc = self._spawn(
            name,
            [
                str(VENV_BIN / "flwr"),
                "run",
                str(self.app),
                "fedexlora-test",
                "--stream",
                "-c",
                pairs,
            ],
        )
        self.others.append(proc)
        return proc

    def kill_supernode(self, i: int) -> None:
        """A crash: SIGKILL the SuperNode and everything it started."""
        _stop([self.supernodes[i]], sig=signal.SIGKILL, wait=5)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        _stop([*self.others, *self.supernodes.values()])
        if self.superlink is not None:
            _stop([self.superlink])


def _deploy_cfg(tiny_bert_dir, tiny_csv):
    from fedexlora.config import RunConfig

    return RunConfig(
        model=tiny_bert_dir,
        task=tiny_csv,  # a small CSV: every ClientApp process loads the task afresh
        methods=["fedex"],
        num_clients=2,
        max_train=40,
        max_test=20,
        min_partition_size=5,
        rounds=3,
        keep_checkpoints=3,  # the rounds 1 and 2 checkpoints are compared too
        local_steps=2,
        batch_size=8,
        max_length=32,
        lora_r=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
    )


def _rows(path: Path) -> list[dict]:
    return read_metrics(path) if path.is_file() else []


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A SuperLink (its state in a database) and two SuperNodes on 127.0.0.1, by PID.

    The flwr-clientapp (one per message) and flwr-serverapp processes Flower starts are
    forked from one that imported torch and peft once (tests/warm.py): the rest of the
    deployment runs as a user's would. The SuperNodes' worker groups live in a folder of
    the module's own. Everything is stopped at the module's end, and checked gone.
    """
    from warm import WarmServer

    root = tmp_path_factory.mktemp("deployment")
    fed = Federation(root / "federation", database=root / "superlink.db")
    fed.env["FEDEXLORA_WORKERS_DIR"] = str(root / "workers")
    warm = WarmServer(root / "warm", python=str(VENV_BIN / "python"), env=fed.env)
    fed.env = warm.env(fed.env)
    try:
        warm.wait_ready()
        fed.start()
        yield fed, warm, root
    finally:
        fed.stop()
        warm.stop()
    started = [fed.superlink, *fed.supernodes.values(), *fed.others]
    assert all(p is None or p.poll() is not None for p in started)  # all stopped, by PID


@pytest.fixture(scope="module")
def deployed(federation, tiny_bert_dir, tiny_csv):
    """One deployment, three rounds, two crashes: the SuperLink, then a SuperNode.

    A SuperLink with its state in a database and two SuperNodes. ``flwr run`` starts the
    job; right after round 1's checkpoint is written, the SuperLink (and the ServerApp it
    started) get SIGKILL. The SuperLink restarts on the same database and the run is
    resumed with ``flwr run ... resume=RUN_DIR``: the SuperNodes stayed up, but their
    ClientApps lost their Contexts with the old run, so the server re-syncs them from W0.
    Right after round 2's row is written, SuperNode 1 and everything it started get
    SIGKILL (the SuperLink learns it only when the node's heartbeat lapses), so round 3
    goes on without it.

    While the run finishes, the in-process reference is computed: the same job where
    client 1 is not sampled in round 3. (One scenario instead of three separate
    deployments: each ClientApp message starts a process that imports torch, transformers
    and peft, and on the 2-core CI machine that is what a deployment test costs.)
    """
    from fedexlora.run.build import new_model, new_server, prepare
    from fedexlora.run.checkpoint import latest_checkpoint
    from fedexlora.run.inprocess import run_method

    fed, _warm, root = federation
    cfg = _deploy_cfg(tiny_bert_dir, tiny_csv)
    run_dir = root / "run"
    t0 = time.perf_counter()
    proc = fed.run(cfg, run_dir)
    deadline = time.monotonic() + 600
    ckpts = run_dir / "checkpoints" / "fedex"
    while True:
        done = latest_checkpoint(ckpts) if ckpts.is_dir() else None
        if done is not None and done.name == "round-0001":
            break
        assert proc.poll() is None, "flwr run ended early\n" + fed.log("flwr-run")
        assert time.monotonic() < deadline, "no round 1 in time\n" + fed.log("flwr-run")
        time.sleep(0.1)
    one_round = time.perf_counter() - t0
    _stop([fed.superlink], sig=signal.SIGKILL, wait=5)  # with the ServerApp it started
    _stop([proc], wait=10)
    rows_when_killed = len(_rows(run_dir / "metrics.jsonl"))

    fed.start_superlink("superlink-restarted")
    again = fed.run(cfg, run_dir, name="flwr-run-resumed", resume=str(run_dir))
    while len(_rows(run_dir / "metrics.jsonl")) < 2:
        assert again.poll() is None, "resumed run ended early\n" + fed.log("flwr-run-resumed")
        assert time.monotonic() < deadline, "no round 2 in time\n" + fed.log("flwr-run-resumed")
        time.sleep(0.25)
    fed.kill_supernode(1)

    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    prep = prepare(cfg, tok, task)
    server = new_server(cfg, "fedex", model)
    sample = server.sample
    server.sample = lambda rnd: [c for c in sample(rnd) if (rnd, c) != (3, 1)]
    snapshots = {}

    def snapshot(row, _srv, mdl):
        snapshots[row["round"]] = {k: v.detach().clone() for k, v in mdl.state_dict().items()}

    ref_rows, ref_model, _ = run_method(
        cfg, "fedex", prep, model=model, server=server, progress=False, after_round=snapshot
    )
    try:
        again.wait(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("resumed run did not finish\n" + fed.log("flwr-run-resumed"))
    total = time.perf_counter() - t0
    assert again.returncode == 0, fed.log("flwr-run-resumed")
    deadline = time.monotonic() + 300
    while len(_rows(run_dir / "metrics.jsonl")) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # --stream returns when the run ends; the file is written by then
    yield {
        "cfg": cfg,
        "run_dir": run_dir,
        "rows": _rows(run_dir / "metrics.jsonl"),
        "rows_when_killed": rows_when_killed,
        "ref_rows": ref_rows,
        "ref_after": snapshots,
        "ref_model": ref_model,
        "one_round_s": one_round,
        "total_s": total,
        "log": fed.log("flwr-run"),
        "resumed_log": fed.log("flwr-run-resumed"),
    }


def _checkpoint_model(cfg, run_dir: Path, rnd: int):
    task = load_task_for(cfg)
    ckpt = run_dir / "checkpoints" / "fedex" / f"round-{rnd:04d}"
    model, _, server, _ = restore_model(cfg, task, "fedex", ckpt, None)
    assert server.round == rnd
    return model


@pytest.mark.integration
def test_deployment_two_supernodes_matches_in_process(deployed):
    cfg, run_dir, rows = deployed["cfg"], deployed["run_dir"], deployed["rows"]
    assert [r["round"] for r in rows] == [1, 2, 3], deployed["resumed_log"]  # errors don't fail
    for r, ref in zip(rows[:2], deployed["ref_rows"][:2]):
        assert r["sampled"] == r["accepted"] == [0, 1] and r["dropped"] == []
        assert r["effective_deviation"]["max"] < 1e-5
        assert set(r) == set(ref)
        assert r["num_examples"] == ref["num_examples"] and r["bytes_down"] == ref["bytes_down"]
        assert r["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    for name in ("config.toml", "summary.md", "metrics.png"):
        assert (run_dir / name).is_file()
    # round 1 came from the first ServerApp, round 2 from the resumed one
    diffs = [_rel_diff(_checkpoint_model(cfg, run_dir, rnd).state_dict(),
                       deployed["ref_after"][rnd]) for rnd in (1, 2)]  # fmt: skip
    print(
        f"\ndeployment: {deployed['one_round_s']:.1f}s from `flwr run` to round 1's "
        f"checkpoint; max relative difference vs in-process after rounds 1, 2: {diffs}"
    )
    assert max(diffs) < 1e-5


@pytest.mark.integration
def test_superlink_killed_after_round_1_then_resumed(deployed):
    """SIGKILL of the SuperLink and its ServerApp after round 1; restarted, resumed."""
    assert deployed["rows_when_killed"] < 3
    assert "resuming fedex after round 1" in deployed["resumed_log"]
    rows = deployed["rows"]
    assert [r["round"] for r in rows] == [1, 2, 3]  # no round lost, none written twice
    assert rows[1]["accepted"] == [0, 1]  # the ClientApps were re-synced and took part
    assert all(r["effective_deviation"]["max"] < 1e-5 for r in rows)


@pytest.mark.integration
def test_supernode_killed_mid_round(deployed):
    cfg, rows = deployed["cfg"], deployed["rows"]
    assert len(rows) == 3, deployed["resumed_log"]
    last = rows[2]
    assert last["sampled"] == [0, 1] and last["dropped"] == [1] and last["accepted"] == [0]
    assert last["num_examples"] == deployed["ref_rows"][2]["num_examples"]
    assert last["effective_deviation"]["max"] < 1e-5  # exact over the clients that reported
    got, _ = _final_model(cfg, deployed["run_dir"], "fedex")
    diff = _state_dict_rel_diff(got, deployed["ref_model"])
    print(
        f"\nafter both crashes: run finished {deployed['total_s']:.1f}s after start; "
        f"max relative difference vs in-process {diff:.2e}"
    )
    assert diff < 1e-5


# -- a client on two processes (DDP, gloo) in each SuperNode ----------------------------
def _group_pids(group_dir: Path) -> tuple:
    """``(launcher pid, rank pids)`` of a worker group, as its files say (``()``: none yet)."""
    try:
        launcher = json.loads((group_dir / "group.json").read_text())["launcher_pid"]
        ranks = sorted(int(p.read_text()) for p in group_dir.glob("rank-*.pid"))
    except (OSError, ValueError, KeyError):
        return ()
    return (launcher, tuple(ranks)) if len(ranks) == 2 else ()


def _effective_weights(cfg, run_dir: Path) -> dict:
    """The final global model's adapted layers, their effective weights (its checkpoint)."""
    from fedexlora.bridge.adapters import lora_layers
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints" / "fedex")
    model = restore_model(cfg, load_task_for(cfg), "fedex", ckpt, None)[0]
    return {n: effective_weight(layer) for n, layer in lora_layers(model).items()}


@pytest.fixture(scope="module")
def two_process_run(federation, tiny_bert_dir, tiny_csv):
    """The module's federation again, each SuperNode's client on two processes (DDP, gloo).

    A second job on the same SuperLink and SuperNodes (a deployment's start is most of its
    cost): ``nproc-per-client = 2``, two rounds, the client adapters saved. SuperNode 1,
    killed by :func:`deployed`, is started again first. While the run goes, a thread
    notes the pids of the node's worker group whenever a job is handed to it. Then the
    SuperNodes and the processes that started the ClientApps (the group's owner: here the
    warm server) are stopped, and whatever of the group is left is looked for.
    """
    from fedexlora.config import load_config

    fed, warm, root = federation
    for i, node in fed.supernodes.items():
        if node.poll() is not None:
            fed.start_supernode(i)
    cfg = _deploy_cfg(tiny_bert_dir, tiny_csv).replace(
        rounds=2, keep_checkpoints=1, lr=2e-2, save_client_adapters=True, nproc_per_client=2
    )
    run_dir = root / "run-2proc"
    workers = root / "workers"
    seen: dict[int, tuple] = {}  # job number -> the group's pids when it was handed over
    samples: set[tuple] = set()  # every (launcher, ranks) seen while the run went
    done = threading.Event()

    def watch():
        while not done.is_set():
            for group in workers.glob("*/"):
                pids = _group_pids(group)
                if pids:
                    samples.add(pids)
                    for job in group.glob("jobs/*.json"):
                        seen.setdefault(int(job.stem), pids)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    proc = fed.run(cfg, run_dir, name="flwr-run-2proc")
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the two-process run did not finish\n" + fed.log("flwr-run-2proc"))
    finally:
        done.set()
        watcher.join()
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, fed.log("flwr-run-2proc")
    groups = sorted(workers.glob("*/"))
    pids = [_group_pids(g) for g in groups]
    # the group ends with its owner: stop the SuperNodes and the ClientApps' parent
    _stop(list(fed.supernodes.values()))
    warm.stop()
    everyone = [p for launcher_ranks in pids if launcher_ranks for p in
                (launcher_ranks[0], *launcher_ranks[1])]  # fmt: skip
    t_stop, deadline = time.monotonic(), time.monotonic() + 30
    while any(_alive(p) for p in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in everyone if _alive(p)]
    gone_after = time.monotonic() - t_stop
    for p in left:  # a failing check leaves nothing behind either
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return {
        "cfg": load_config(run_dir / "config.toml"),
        "run_dir": run_dir,
        "rows": _rows(run_dir / "metrics.jsonl"),
        "groups": groups,
        "seen": seen,
        "samples": samples,
        "left": left,
        "gone_after_s": gone_after,
        "seconds": seconds,
        "log": fed.log("flwr-run-2proc"),
    }


def _alive(pid: int) -> bool:
    from fedexlora.run.workers import _alive as alive

    return alive(pid)


@pytest.mark.integration
@pytest.mark.multiprocess
def test_two_process_clients_deployment_is_exact(two_process_run):
    """The global model equals the fp64 ideal of the saved client adapters within 1e-5."""
    from conftest import load_script

    cfg, run_dir, rows = two_process_run["cfg"], two_process_run["run_dir"], two_process_run["rows"]
    assert cfg.nproc_per_client == 2 and cfg.distributed == "ddp"
    assert [r["round"] for r in rows] == [1, 2], two_process_run["log"]
    assert all(r["accepted"] == [0, 1] and r["dropped"] == [] for r in rows)
    verify = load_script("benchmarks/verify_export.py")
    ideal, w0 = verify.ideal_from_client_adapters(run_dir, cfg)
    err = verify.rel(_effective_weights(cfg, run_dir), ideal, w0)
    print(
        f"\ntwo processes per client: run {two_process_run['seconds']:.1f}s; global model "
        f"vs the fp64 ideal of the saved adapters {err:.2e} of the update"
    )
    assert err <= 1e-5


@pytest.mark.integration
@pytest.mark.multiprocess
def test_two_process_group_started_once_and_kept_across_rounds(two_process_run):
    """One group served all four jobs (two clients, two rounds); each rank loaded once."""
    groups, seen = two_process_run["groups"], two_process_run["seen"]
    assert len(groups) == 1  # the two SuperNodes of one machine share their group
    # its jobs (a fresh group starts a fresh folder): both clients of both rounds
    files = sorted(groups[0].glob("jobs/*.json"), key=lambda p: int(p.stem))
    assert [p.name for p in files] == ["1.json", "2.json", "3.json", "4.json"]
    jobs = [json.loads(p.read_text()) for p in files]
    assert sorted((j["round"], j["client"]) for j in jobs) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert sorted(seen) == [1, 2, 3, 4]
    assert len(set(seen.values())) == 1, seen  # the same launcher and ranks for every job
    assert len(two_process_run["samples"]) == 1, two_process_run["samples"]
    launcher, ranks = seen[1]
    loads = [json.loads(x) for x in (groups[0] / "loads.log").read_text().splitlines()]
    assert sorted((x["rank"], x["pid"]) for x in loads) == list(enumerate(ranks))


@pytest.mark.integration
@pytest.mark.multiprocess
def test_two_process_group_outlives_no_deployment(two_process_run):
    """The group ends with its owner (the ClientApps' parent) once the SuperNodes stop."""
    print(f"\nworker group gone {two_process_run['gone_after_s']:.1f}s after its owner")
    assert two_process_run["samples"]  # there was a group to watch
    assert two_process_run["left"] == []
