"""A SuperNode's own data file (``--node-config data=PATH``): what it trains on, and the
problems of a file the server never sees, reported with the node's name and the file's;
and where it keeps the adapters it trains (``adapters-dir=DIR``).
Its equality with the run on the task's slices is held on both engines by
``test_engine_parity.py::test_each_client_trains_on_its_own_file_on_both_engines``."""

import json
import re

import pytest

from test_flower import InProcessGrid
from test_flower_parity import _flower


class FlowerGrid(InProcessGrid):
    """As Flower's runtime does: a ClientApp's exception becomes the node's error reply
    (``run_clientapp``), never a raise in the server's process."""

    @property
    def app(self):
        return self._app

    @app.setter
    def app(self, client_app):
        from flwr.app import Error, Message

        def run(msg, ctx):
            try:
                return client_app(msg, ctx)
            except Exception as exc:  # as flwr.supernode.runtime.run_clientapp
                reason = f"{type(exc)}:<'{exc}'>"
                return Message(error=Error(code=0, reason=reason), reply_to=msg)

        self._app = run


def _nodes(data: dict, key: str = "data"):
    return [{"partition-id": i, "num-partitions": 3, **({key: data[i]} if i in data else {})}
            for i in range(3)]  # fmt: skip


def _file(path, labels):
    path.write_text("".join(json.dumps({"text": "goal match vote", "label": y}) + "\n"
                            for y in labels))  # fmt: skip
    return str(path)


def _slices(cfg):
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.restore import load_task_for

    task = load_task_for(cfg)
    return prepare(cfg, new_model(cfg, task, "fedex")[1], task).parts


def test_a_node_whose_data_file_is_missing_stops_the_run_before_training(
    tiny_cfg, tmp_path, task_identity
):
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1)
    missing = str(tmp_path / "nowhere.jsonl")
    grid = FlowerGrid(make_client_app({}), 3, node_configs=_nodes({1: missing}))
    with pytest.raises(
        ValueError, match=re.escape(f"node config data: no such file on this node: {missing!r}")
    ):
        _flower(cfg, tmp_path / "run", grid=grid)
    assert grid.trained == []


def test_a_node_trains_on_its_own_rows_and_reports_their_count(tiny_cfg, tmp_path, task_identity):
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1)
    own = _file(tmp_path / "1.jsonl", ["sport", "politics"] * 3)  # 6 rows, not its slice's
    grid = FlowerGrid(make_client_app({}), 3, node_configs=_nodes({1: own}))
    rows, _ = _flower(cfg, tmp_path / "run", grid=grid)
    assert rows[0]["accepted"] == [0, 1, 2]
    slices = _slices(cfg)
    assert rows[0]["num_examples"] == len(slices[0]) + 6 + len(slices[2])


def test_a_node_whose_file_names_another_class_stops_the_run_before_training(
    tiny_cfg, tmp_path, task_identity
):
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1)
    own = _file(tmp_path / "2.jsonl", ["sport", "tech"])
    grid = FlowerGrid(make_client_app({}), 3, node_configs=_nodes({2: own}))
    with pytest.raises(ValueError, match=r"row 1 has label 'tech', which is not one of the task"):
        _flower(cfg, tmp_path / "run", grid=grid)
    assert grid.trained == []


class _Spoiled(list):
    """``grid.trained`` that spoils ``path`` once round 1 has trained: a file that fitted
    at the query and no longer does."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, key):
        super().append(key)
        if key == (1, 2):  # round 1 over: every node trained it
            _file(self.path, ["tech"])


def test_a_node_whose_file_stops_fitting_mid_run_stops_the_run(tiny_cfg, tmp_path, task_identity):
    """Not a run without the node: its error reply stops the run, naming the row."""
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=3, local_steps=1)
    path = tmp_path / "1.jsonl"
    grid = FlowerGrid(make_client_app({}), 3, node_configs=_nodes({1: _file(path, ["sport"] * 4)}))
    grid.trained = _Spoiled(path)
    with pytest.raises(
        Exception, match=r"client 1 stopped the run: node config data: .*row 0 has label 'tech'"
    ):
        _flower(cfg, tmp_path / "run", grid=grid)
    assert [r for r, _ in grid.trained] == [1, 1, 1, 2, 2, 2]


def test_under_secure_aggregation_the_files_problem_stays_in_the_nodes_log(
    tiny_cfg, tmp_path, task_identity
):
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=1, secure_aggregation=True)
    own = _file(tmp_path / "2.jsonl", ["sport", "tech"])
    grid = FlowerGrid(make_client_app({}), 3, node_configs=_nodes({2: own}))
    with pytest.warns(UserWarning, match=r"row 1 has label 'tech'"):
        with pytest.raises(Exception, match=r"its reasons stay in its own log") as err:
            _flower(cfg, tmp_path / "run", grid=grid)
    assert "tech" not in str(err.value) and "2.jsonl" not in str(err.value)


def test_a_node_keeps_its_adapters_where_its_own_config_says(tiny_cfg, tmp_path, task_identity):
    """The adapter a node trains is its own: it keeps it in its ``adapters-dir`` every
    round, though the run does not ask (``save_client_adapters`` off); nodes without one
    keep none, and nothing is written into the server's run directory."""
    from fedexlora.flower.client_app import make_client_app

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2, local_steps=1)
    mine = tmp_path / "node-1"
    grid = InProcessGrid(
        make_client_app({}), 3, node_configs=_nodes({1: str(mine)}, "adapters-dir")
    )
    _flower(cfg, tmp_path / "run", grid=grid)
    kept = sorted(p.parent.relative_to(mine).as_posix() for p in mine.rglob("adapter_config.json"))
    assert kept == ["run-7/fedex/clients/round-1/client-1", "run-7/fedex/clients/round-2/client-1"]
    assert not list((tmp_path / "run").rglob("adapter_config.json"))
