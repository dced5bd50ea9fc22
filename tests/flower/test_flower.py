"""The Flower app's own pieces, without a Flower run: the run config and the records it
travels in, the pyproject that declares the apps and every key, what the ServerApp
refuses before its first round, and what the simulation launcher starts ``flwr run``
with.

The Flower engine against the in-process engine is in ``test_flower_parity.py`` (over an
in-process grid, no Ray: the strategy, dropout and re-sync, feature by feature, resume),
``test_flower_simulation.py`` (``run_flower_experiment`` through Flower's simulation
runtime) and ``test_flower_deploy.py`` (a real SuperLink and SuperNodes); the in-process
grid (:class:`InProcessGrid`) and the comparisons of two runs' models are here, for them.
"""

import sys
from pathlib import Path
from uuid import uuid4

import pytest
from flwr.serverapp import Grid

from fedexlora.run.checkpoint import latest_checkpoint
from fedexlora.run.restore import load_task_for, restore_model

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
ROW_FIELDS = {
    "method",
    "round",
    "metrics",
    "test_examples",
    "train_loss",
    "seconds",
    "server_seconds",
    "bytes_up",
    "bytes_down",
    "bytes_down_max",
    "server_bytes",
    "deviation",
    "effective_deviation",
    "residual_rank",
    "sampled",
    "accepted",
    "rejected",
    "dropped",
    "num_examples",
    "approximate",
}


# -- helpers: an in-process grid (no Ray, no sockets), two runs' models compared -----
def _final_model(cfg, run_dir, method):
    task = load_task_for(cfg)
    ckpt = latest_checkpoint(Path(run_dir) / "checkpoints" / method)
    assert ckpt is not None, f"no checkpoint for {method} in {run_dir}"
    model, _, server, _ = restore_model(cfg, task, method, ckpt, None)
    return model, server


class InProcessGrid(Grid):
    """A Flower Grid that runs the ClientApp here, one Context per node; every message
    and reply goes through Flower's protobuf serialization, as between processes.

    ``lose`` holds (round, partition) pairs whose node crashes after training, before its
    reply is sent: the client's state moved on but the server never hears of it.
    """

    def __init__(self, client_app, num_nodes, lose=(), node_configs=None):
        from flwr.app import Context, RecordDict

        self.app = client_app
        node_configs = node_configs or [
            {"partition-id": i, "num-partitions": num_nodes} for i in range(num_nodes)
        ]
        self.contexts = {
            1000 + i: Context(
                run_id=7,
                node_id=1000 + i,
                node_config=conf,
                state=RecordDict(),
                run_config={},
            )
            for i, conf in enumerate(node_configs)
        }
        self.lose = set(lose)
        self.trained = []  # (round, partition) of every training message run
        self.replies = []  # every reply delivered to the server, in order

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.common.serde import message_from_proto, message_to_proto

        def wire(m):  # each way through Flower's protobuf, as between processes
            return message_from_proto(message_to_proto(m))

        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
            ctx = self.contexts[msg.metadata.dst_node_id]
            reply = wire(self.app(wire(msg), ctx))
            if msg.metadata.message_type == "train":
                key = (int(msg.content["config"]["server-round"]), ctx.node_config["partition-id"])
                self.trained.append(key)
                if key in self.lose:
                    continue
            replies.append(reply)
        self.replies.extend(replies)
        return replies


def _model_rel_diff(a, b) -> float:
    """``||a - b|| / ||b||`` over every tensor of the two models together."""
    ref = b.state_dict()
    num = sum(float((t.double() - ref[n].double()).norm()) ** 2 for n, t in a.state_dict().items())
    den = sum(float(t.double().norm()) ** 2 for t in ref.values())
    return (num / den) ** 0.5


def _rel_diff(a: dict, b: dict) -> float:
    """The largest ``||a[n] - b[n]|| / ||b[n]||`` over the tensors of two state dicts."""
    worst = 0.0
    for name, t in a.items():
        u, v = t.double(), b[name].double()
        den = float(v.norm())
        worst = max(worst, float((u - v).norm()) / den if den > 0 else float(u.norm()))
    return worst


def _state_dict_rel_diff(a, b) -> float:
    """:func:`_rel_diff` of two models' state dicts."""
    return _rel_diff(a.state_dict(), b.state_dict())


# -- run config ------------------------------------------------------------------------
def test_run_config_round_trip(tiny_cfg):
    from fedexlora.flower.records import resolve_run_config, to_run_config

    rc = to_run_config(tiny_cfg, run_dir="/tmp/x", min_train_nodes=2)
    assert (
        rc["method"] == "fedex,fedit" and rc["target-modules"] == "query,value,intermediate.dense"
    )
    assert all(isinstance(v, (bool, int, float, str)) for v in rc.values())
    cfg, settings = resolve_run_config(rc)
    assert cfg == tiny_cfg.replace(engine="flower")
    assert settings.run_dir == "/tmp/x" and settings.min_train_nodes == 2
    # "" means unset, as in [tool.flwr.app.config]
    cfg2, _ = resolve_run_config({**rc, "max-train": "", "local-steps": ""})
    assert cfg2.max_train is None and cfg2.local_steps is None


def test_records_carry_payloads_and_cast_bf16_to_fp32():
    import torch

    from fedexlora.core.aggregation import Residual
    from fedexlora.core.state import AdapterState
    from fedexlora.flower.records import from_array_record, to_array_record
    from fedexlora.server import Payload

    g = torch.Generator().manual_seed(0)
    state = AdapterState(
        factors={"m": (torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g))},
        extra={"head": torch.randn(3, generator=g).to(torch.bfloat16)},
    )
    U = torch.randn(4, 3, generator=g, dtype=torch.float64)
    V = torch.randn(3, 5, generator=g, dtype=torch.float64)
    payload = Payload(round=2, version=1, state=state, residuals={"m": Residual((4, 5), U=U, V=V)})
    back = from_array_record(to_array_record(payload.to_flat()))
    assert back["state.extra.head"].dtype == torch.float32  # numpy has no bf16
    assert torch.equal(back["state.extra.head"], state.extra["head"].float())
    assert back["residual.m.U"].dtype == torch.float64  # other dtypes travel as they are
    got = Payload.from_flat(back, round=2, version=1)
    assert torch.equal(got.state.factors["m"][0], state.factors["m"][0])
    assert torch.equal(got.residuals["m"].to_dense(), payload.residuals["m"].to_dense())


def test_run_config_errors_are_listed(tiny_cfg):
    from fedexlora.config import ConfigError
    from fedexlora.flower.records import resolve_run_config, to_run_config

    rc = {**to_run_config(tiny_cfg), "num-clientz": 3, "lr": -1.0, "min-train-nodes": 0}
    with pytest.raises(ConfigError) as err:
        resolve_run_config(rc)
    text = str(err.value)
    assert "unknown key `num-clientz`; did you mean `num_clients`?" in text
    assert "`lr` must be > 0" in text and "`min-train-nodes` must be >= 1" in text


def test_pyproject_declares_the_apps_and_every_key():
    import tomllib

    from fedexlora.config import RunConfig
    from fedexlora.flower.records import FLOWER_KEYS, resolve_run_config, to_run_config

    flwr = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert flwr["components"] == {
        "serverapp": "fedexlora.flower.server_app:app",
        "clientapp": "fedexlora.flower.client_app:app",
    }
    assert flwr["publisher"]
    cfg, _ = resolve_run_config(flwr["config"])  # the defaults form a valid run
    assert cfg.engine == "flower"
    # `flwr run -c` overrides only declared keys: every setting must be there, those
    # unset by default too (to_dict() leaves a None out: each field, by its name)
    from dataclasses import fields

    from fedexlora.flower.records import _LOCAL_ONLY

    everything = {
        "method" if f.name == "methods" else f.name.replace("_", "-")
        for f in fields(RunConfig)
        if f.name not in _LOCAL_ONLY
    }
    assert set(FLOWER_KEYS) | set(everything) <= set(flwr["config"])
    # and at the configuration's defaults ("" for unset), but for the deployment guide's
    # two SuperNodes (docs/DEPLOY.md): one source, which this copy Flower needs follows
    defaults = to_run_config(RunConfig())
    declared = {k: v for k, v in flwr["config"].items() if k in everything}
    assert declared == {**{k: "" for k in everything}, **defaults, "num-clients": 2}


def test_centralized_is_refused(tiny_cfg, tmp_path):
    from fedexlora.flower.simulation import run_flower_experiment

    with pytest.raises(ValueError, match="'centralized' .* runs in-process only"):
        run_flower_experiment(tiny_cfg.replace(methods=["fedex", "centralized"]), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_flwr_run_validates_as_fedexlora_validate_does(tiny_cfg, tmp_path):
    """The ServerApp refuses what its engine cannot do before the first round, naming it."""
    from fedexlora.config import ConfigError
    from fedexlora.flower.records import FlowerSettings, resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    rc = to_run_config(tiny_cfg.replace(methods=["fedex", "centralized"]))
    with pytest.raises(ConfigError, match="'centralized' has no clients"):
        resolve_run_config(rc)
    rc = to_run_config(tiny_cfg)
    with pytest.raises(ConfigError, match="`client_ranks` needs one rank per client"):
        resolve_run_config({**rc, "client-ranks": "2,4"})
    with pytest.raises(ConfigError, match="`recipe`: unknown recipe 'paper-nope'; choose from"):
        resolve_run_config({**rc, "recipe": "paper-nope"})
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="'centralized' has no clients"):
        bad = tiny_cfg.replace(methods=["centralized"])
        run_server(None, bad, FlowerSettings(run_dir=str(run_dir)), say=lambda *_: None)
    assert not run_dir.exists()
    cfg, _ = resolve_run_config({**rc, "client-ranks": "2,4,4", "method": "fedex"})
    assert cfg.client_ranks == [2, 4, 4] and cfg.engine == "flower"


# -- the simulation launcher: what `flwr run` and Ray are started with -----------------
def test_simulation_goes_through_flwr_run_on_loopback_with_statistics_off(
    tiny_cfg, tmp_path, monkeypatch
):
    """What the private SuperLink, SuperExec and ``flwr run`` are started with.

    Ray binds to loopback with its statistics off, Flower's telemetry and update check
    are off (a user's own setting wins), and only the SuperExec, below which Ray's
    daemons start, gets the private HOME with a local-provider bootstrap config.
    """
    import os

    import fedexlora.flower.simulation as sim
    from fedexlora.run.layout import RunError

    seen = {}

    def fake_start(self):
        seen["sim"] = self
        bootstrap = Path(self.exec_env["HOME"]) / "ray_bootstrap_config.yaml"
        seen["bootstrap"] = bootstrap.read_text() if self.root in bootstrap.parents else None
        seen["app"] = (self.root / "app" / "pyproject.toml").read_text()
        return self

    def fake_run(self, app_dir, federation, write=None):
        seen["federation"] = federation
        return 0, []

    monkeypatch.setattr(sim.LocalSimulation, "start", fake_start)
    monkeypatch.setattr(sim.LocalSimulation, "run", fake_run)
    for var in ("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                "FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    home = os.environ["HOME"]
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, num_clients=3)
    with pytest.raises(RunError, match="wrote 0 of 1 metrics rows"):
        sim.run_flower_experiment(cfg, tmp_path / "a", client_cpus=1)
    s = seen["sim"]
    for env in (s.env, s.exec_env):
        assert env["RAY_USAGE_STATS_ENABLED"] == "0"
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # loopback only
        assert env["FLWR_TELEMETRY_ENABLED"] == "0" and env["FLWR_DISABLE_UPDATE_CHECK"] == "1"
        assert env["FLWR_HOME"] == str(s.root / "flwr-home")
    assert s.env["HOME"] == home and sim.USER_HOME_VAR not in s.env
    assert s.exec_env["HOME"] != home and s.exec_env[sim.USER_HOME_VAR] == home
    assert seen["bootstrap"] == "provider:\n  type: local\n"
    assert 'serverapp = "fedexlora.flower.server_app:app"' in seen["app"]
    assert "num-clients = 3" in seen["app"] and f'run-dir = "{tmp_path / "a"}"' in seen["app"]
    assert seen["federation"] == (
        "num-supernodes=3 client-resources-num-cpus=1 client-resources-num-gpus=0.0"
    )
    assert not s.root.exists()  # Flower's home, the app and the private HOME are removed
    assert not os.environ.get("RAY_USAGE_STATS_ENABLED")  # this process is untouched
    # the user's own settings win; statistics on: Ray keeps the real HOME, probe included
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "1")
    with pytest.raises(RunError):
        sim.run_flower_experiment(cfg, tmp_path / "b")
    s = seen["sim"]
    assert s.exec_env["RAY_USAGE_STATS_ENABLED"] == "1" and s.exec_env["HOME"] == home
    assert s.env["FLWR_TELEMETRY_ENABLED"] == "1"


def test_backend_config_maps_to_the_federation_config():
    from fedexlora.flower.simulation import federation_config

    assert federation_config(
        2, {"client_resources": {"num_cpus": 2, "num_gpus": 0.5},
            "init_args": {"include_dashboard": False, "num_cpus": 4,
                          "logging_level": "warning", "log_to_driver": True}},
    ) == (
        "num-supernodes=2 client-resources-num-cpus=2 client-resources-num-gpus=0.5 "
        'init-args-num-cpus=4 init-args-logging-level="warning" init-args-log-to-driver=true'
    )  # fmt: skip
    with pytest.raises(ValueError, match="'address' cannot be passed .* RAY_ADDRESS"):
        federation_config(2, {"init_args": {"address": "auto"}})
    assert federation_config(1, {"client_resources": {"num_cpus": 2.0}}) == (
        "num-supernodes=1 client-resources-num-cpus=2"
    )  # FEDEXLORA_CLIENT_CPUS=2 reads as 2.0
    with pytest.raises(ValueError, match=r"\['num_cpus'\] must be a whole number .* 0.5"):
        federation_config(1, {"client_resources": {"num_cpus": 0.5}})
    with pytest.raises(ValueError, match="unknown section 'resources'"):
        federation_config(2, {"resources": {}})


def test_ray_cpus_caps_the_simulation_and_bad_values_are_named(tiny_cfg, monkeypatch):
    from fedexlora.flower.simulation import federation_config, simulation_backend

    monkeypatch.delenv("FEDEXLORA_CLIENT_CPUS", raising=False)
    monkeypatch.delenv("FEDEXLORA_RAY_CPUS", raising=False)
    assert "init_args" not in simulation_backend(tiny_cfg, client_cpus=1)  # Ray's default
    monkeypatch.setenv("FEDEXLORA_RAY_CPUS", "1")
    backend = simulation_backend(tiny_cfg, client_cpus=1)
    assert backend == {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": 1},
    }
    assert federation_config(3, backend) == (
        "num-supernodes=3 client-resources-num-cpus=1 client-resources-num-gpus=0.0 "
        "init-args-num-cpus=1"
    )
    for bad in ("0", "1.5", "two", "-2"):
        monkeypatch.setenv("FEDEXLORA_RAY_CPUS", bad)
        with pytest.raises(ValueError, match=f"FEDEXLORA_RAY_CPUS must be a whole .*'{bad}'"):
            simulation_backend(tiny_cfg)


def test_by_default_one_client_app_at_a_time_per_device(tiny_cfg, monkeypatch):
    """Each concurrent ClientApp holds a model and a training working set of its own (the
    in-process engine's whole memory, docs/BENCHMARKS.md): by default one per device."""
    import torch

    from fedexlora.flower import simulation

    for var in ("FEDEXLORA_CLIENT_CPUS", "FEDEXLORA_CLIENT_GPUS", "FEDEXLORA_RAY_CPUS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(simulation.os, "cpu_count", lambda: 8)
    cfg = tiny_cfg.replace(num_clients=10)
    # CPU: one actor with every CPU (its threads), whatever the number of clients
    assert simulation.client_resources(cfg) == {"num_cpus": 8, "num_gpus": 0.0}
    monkeypatch.setenv("FEDEXLORA_RAY_CPUS", "3")  # Ray capped: one actor with all of it
    assert simulation.simulation_backend(cfg) == {
        "client_resources": {"num_cpus": 3, "num_gpus": 0.0},
        "init_args": {"num_cpus": 3},
    }
    monkeypatch.setenv("FEDEXLORA_CLIENT_CPUS", "1")  # asked for: 3 clients at once
    assert simulation.client_resources(cfg) == {"num_cpus": 1, "num_gpus": 0.0}
    monkeypatch.delenv("FEDEXLORA_CLIENT_CPUS")
    monkeypatch.delenv("FEDEXLORA_RAY_CPUS")
    # CUDA: one actor per GPU, the CPUs shared among them
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu = cfg.replace(device="cuda")
    monkeypatch.setattr("fedexlora.run.build.resolve_device", lambda d: torch.device(d))
    assert simulation.client_resources(gpu) == {"num_cpus": 4, "num_gpus": 1.0}
    assert simulation.client_resources(gpu, client_gpus=0.5)["num_gpus"] == 0.5


def test_a_client_app_gets_the_users_home_back(monkeypatch):
    import os

    from fedexlora.flower.simulation import USER_HOME_VAR, restore_user_home

    monkeypatch.setenv("HOME", "/tmp/private-ray-home")
    monkeypatch.setenv(USER_HOME_VAR, "/home/someone")
    restore_user_home()
    assert os.environ["HOME"] == "/home/someone" and USER_HOME_VAR not in os.environ
    restore_user_home()  # idempotent
    assert os.environ["HOME"] == "/home/someone"


def test_a_node_that_cannot_write_its_adapter_says_so_and_replies(capsys, tmp_path):
    """``adapters-dir`` is the server's path: on another machine it may not be writable.
    The client names the path and goes on (its reply does not depend on the file)."""
    from fedexlora.flower.client_app import _save_adapter

    class Unwritable:
        client = 3
        calls: list = []

        def save_adapter(self, out_dir, rnd, num_examples):
            self.calls.append((out_dir, rnd, num_examples))
            raise PermissionError(13, "Permission denied", str(out_dir))

    node = Unwritable()
    _save_adapter(node, "", 1, 5)  # the server asked for none
    assert node.calls == []
    _save_adapter(node, str(tmp_path / "server-run"), 2, 5)
    assert node.calls == [(tmp_path / "server-run", 2, 5)]
    out = capsys.readouterr().out
    assert "partition 3: could not save its adapter under" in out and "server-run" in out
