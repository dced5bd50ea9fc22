"""A client on two processes (``--nproc-per-client 2``): a worker group, on both engines.

Exact as everywhere (the global model against the fp64 ideal of the SAVED client
adapters), under DDP (fp32 base, with secure aggregation) and FSDP (bf16 base); the
group stays up across rounds (same ranks, the model loaded once); a rank killed with
SIGKILL mid-round stops an in-process run with a clear error within a timeout, no
process of the group outlives it, and ``--resume`` then gives the rows of a straight
run (timings aside); under Flower a killed rank makes that client a dropout of the
round, and the next client starts a fresh group.

A group start (torchrun and two ranks importing torch, transformers and peft, each
loading the model) is the cost here, so the tests share groups in this order: the
straight DDP run's group serves the killed in-process run until the kill; the resume's
fresh group is the one the Flower run finds and kills; the Flower run's fresh group
serves its remaining clients; FSDP then starts its own. Four starts for the five tests
(each test also passes alone, starting what it needs).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import load_script
from fedexlora.run import workers
from fedexlora.run.inprocess import run_experiment

# four worker groups (torchrun and two ranks that import torch, transformers and peft,
# each loading the model) for five tests: 176 s on the 2-core dev machine, load about 7
# (2026-12-06, bytecode cached as scripts/test.sh lets it be)
pytestmark = [pytest.mark.integration, pytest.mark.multiprocess, pytest.mark.slow(seconds=180)]

STOP_S = 2.5  # a stopped group is gone within this (0.2 s measured; 4.5-8 s before _leave)
KILL_TIMEOUT_S = 30.0  # a dead rank is noticed well within this (a stale heartbeat alone: 60 s)


@pytest.fixture(scope="module", autouse=True)
def _own_workers_dir(tmp_path_factory):
    """The module's groups live in a folder of its own, and are stopped at its end."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FEDEXLORA_WORKERS_DIR", str(tmp_path_factory.mktemp("workers")))
    yield
    workers.stop_groups()
    mp.undo()


@pytest.fixture(scope="module")
def bert_no_dropout(tiny_bert_dir, tmp_path_factory):
    """conftest's tiny BERT without its dropout (0.1): a rank draws the dropout masks of
    its share of a batch only, so with dropout no split of a batch trains as one process."""
    import shutil

    d = tmp_path_factory.mktemp("bert-no-dropout")
    shutil.copytree(tiny_bert_dir, d, dirs_exist_ok=True)
    conf = json.loads((d / "config.json").read_text())
    conf.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (d / "config.json").write_text(json.dumps(conf))
    return str(d)


def _cfg(model: str, task: str, **kw):
    """conftest's ``tiny_cfg`` (3 clients, 2 rounds, 3 steps), fedex on 2 processes."""
    from fedexlora.config import RunConfig

    # lr 2e-2 (as test_precision): an update large enough that fp32's rounding of the
    # folded residual stays far below 1e-5 of it
    return RunConfig(
        model=model, task=task, methods=["fedex"], num_clients=3, partition="dirichlet",
        alpha=1.0, min_partition_size=5, rounds=2, local_steps=3, batch_size=8, lr=2e-2,
        max_length=16, lora_r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["query", "value", "intermediate.dense"], save_client_adapters=True,
        nproc_per_client=2, **kw,
    ).validate()  # fmt: skip


def _verify():
    return load_script("benchmarks/verify_export.py")


def final_weights(cfg, run_dir: Path) -> dict:
    """The final global model's adapted layers, their effective weights (from its checkpoint)."""
    from fedexlora.bridge.adapters import lora_layers
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.run.checkpoint import config_fingerprint, latest_checkpoint
    from fedexlora.run.restore import load_task_for, restore_model

    ckpt = latest_checkpoint(run_dir / "checkpoints" / "fedex")
    model = restore_model(cfg, load_task_for(cfg), "fedex", ckpt, config_fingerprint(cfg))[0]
    return {n: effective_weight(layer) for n, layer in lora_layers(model).items()}


def model_vs_ideal(cfg, run_dir: Path) -> float:
    """The final global model's worst layer against the fp64 ideal of the saved adapters."""
    v = _verify()
    ideal, w0 = v.ideal_from_client_adapters(run_dir, cfg)
    return v.rel(final_weights(cfg, run_dir), ideal, w0)


def _no_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, bert_no_dropout, tiny_csv):
    """A straight DDP run under secure aggregation: its rows, directory, and the ranks seen."""
    cfg = _cfg(bert_no_dropout, tiny_csv, secure_aggregation=True)
    run_dir = tmp_path_factory.mktemp("ddp")
    seen = []

    def watch(cfg, method, model, data, rnd, client, **kw):
        up = workers.update_for(cfg)(cfg, method, model, data, rnd, client, **kw)
        seen.append((rnd, client, tuple(workers.WorkerGroup(cfg, method).rank_pids())))
        return up

    rows = run_experiment(cfg, run_dir, progress=False, local_update=watch)
    return cfg, run_dir, rows, seen


def test_ddp_client_is_exact_and_its_group_stays_up(ddp_run):
    cfg, run_dir, rows, seen = ddp_run
    group = workers.WorkerGroup(cfg, "fedex")
    # the same two ranks served every client of both rounds; each loaded the model once
    assert [(r, c) for r, c, _ in seen] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    pids = {p for _, _, p in seen}
    assert len(pids) == 1 and len(next(iter(pids))) == 2
    loads = [json.loads(line) for line in (group.dir / "loads.log").read_text().splitlines()]
    assert sorted(x["rank"] for x in loads) == [0, 1]
    assert {x["pid"] for x in loads} == set(next(iter(pids)))
    # exact: the global model against the fp64 ideal of the saved client adapters
    assert [r["accepted"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    err = model_vs_ideal(cfg, run_dir)
    print(f"ddp (secure aggregation): model vs ideal {err:.3e}")
    assert err <= 1e-5


def test_ddp_client_trains_as_one_process(ddp_run, tmp_path):
    """The same run with each client on one process reaches the same global model."""
    cfg, run_dir, _, _ = ddp_run
    one = cfg.replace(nproc_per_client=1)
    run_experiment(one, tmp_path, progress=False)
    v = _verify()
    w0 = v.ideal_from_client_adapters(tmp_path, one)[1]
    err = v.rel(final_weights(cfg, run_dir), final_weights(one, tmp_path), w0)
    print(f"ddp vs one process: global model {err:.3e} of the update")
    assert err <= 1e-5


def test_killed_rank_stops_the_run_then_resume_equals_a_straight_run(ddp_run, tmp_path):
    cfg, _, straight, _ = ddp_run
    killed: dict[str, float] = {}

    def kill_rank_1_mid_round_2(cfg, method, model, data, rnd, client, **kw):
        if (rnd, client) == (2, 1):
            group = workers.WorkerGroup(cfg, method)
            killed["pids"] = [*group.rank_pids(), group.launcher_pid()]
            victim = group.rank_pids()[1]
            job = group.dir / "jobs" / f"{1 + len(list((group.dir / 'jobs').glob('*.json')))}.json"

            def when_sent():  # SIGKILL as soon as the round's job is handed to the ranks
                while not job.exists():
                    time.sleep(0.002)
                os.kill(victim, signal.SIGKILL)
                killed["at"] = time.monotonic()

            threading.Thread(target=when_sent, daemon=True).start()
        return workers.update_for(cfg)(cfg, method, model, data, rnd, client, **kw)

    with pytest.raises(workers.WorkerGroupError, match=r"failed in round 2 \(client 1\)"):
        run_experiment(cfg, tmp_path, progress=False, local_update=kill_rank_1_mid_round_2)
    noticed = time.monotonic() - killed["at"]
    print(f"killed rank noticed after {noticed:.2f} s")
    assert noticed < KILL_TIMEOUT_S
    assert not [p for p in killed["pids"] if workers._alive(p)]  # no process outlives it
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1]
    resumed = run_experiment(cfg, tmp_path, resume=True, progress=False)
    assert _no_timings(resumed) == _no_timings(straight)


def raising_grid(client_app, num_nodes: int):
    """``test_flower``'s in-process grid, a ClientApp's exception answered as Flower's
    runtime answers it (an error reply)."""
    from flwr.app import Error, Message

    from test_flower import InProcessGrid

    def app(msg, ctx):
        try:
            return client_app(msg, ctx)
        except Exception as ex:  # flwr.supernode.runtime.run_clientapp's reply
            reason = str(type(ex)) + ":<'" + str(ex) + "'>"
            return Message(Error(code=2, reason=reason), reply_to=msg)

    return InProcessGrid(app, num_nodes)


def test_killed_rank_under_flower_is_a_dropout_then_a_fresh_group(
    bert_no_dropout, tiny_csv, tmp_path, task_identity, monkeypatch
):
    """The real ServerApp, strategy and ClientApp over ``test_flower``'s in-process grid
    (every message through Flower's protobuf). Each ClientApp hands its round to the
    node's worker group; a rank SIGKILLed mid-round makes that client's reply an error,
    so the round goes on without it (a dropout in its row), never a hang; the next
    client starts a fresh group, which then serves every client of both rounds."""
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    cfg = _cfg(bert_no_dropout, tiny_csv, engine="flower").replace(save_client_adapters=False)
    rc = to_run_config(cfg, run_dir=str(tmp_path / "run"))
    cfg, settings = resolve_run_config(rc)
    ranks, killed = {}, {}
    real = workers.group_update

    def kill_in_round_1(cfg, method, model, data, rnd, client, **kw):
        group = workers.WorkerGroup(cfg, method)
        if (rnd, client) == (1, 0):  # a group is up (reused, or started now)
            group.ensure()
            killed["pids"] = [*group.rank_pids(), group.launcher_pid()]
            jobs = group.dir / "jobs"
            job = jobs / f"{1 + len(list(jobs.glob('*.json')))}.json"

            def when_sent():  # SIGKILL rank 1 as soon as the round's job is handed over
                while not job.exists():
                    time.sleep(0.002)
                os.kill(killed["pids"][1], signal.SIGKILL)
                killed["at"] = time.monotonic()

            threading.Thread(target=when_sent, daemon=True).start()
        try:
            return real(cfg, method, model, data, rnd, client, **kw)
        except workers.WorkerGroupError:
            killed["noticed"] = time.monotonic() - killed["at"]
            raise
        finally:
            ranks[(rnd, client)] = tuple(group.rank_pids())

    monkeypatch.setattr(workers, "group_update", kill_in_round_1)
    grid = raising_grid(make_client_app(rc), cfg.num_clients)
    why = r"client 0 dropped: .*WorkerGroupError.*failed in round 1 \(client 0\)"
    with pytest.warns(UserWarning, match=why):  # the strategy's word on the dropout
        run_server(grid, cfg, settings, say=lambda *_: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["dropped"] == [0] and rows[0]["accepted"] == [1, 2]
    print(f"killed rank noticed after {killed['noticed']:.2f} s")
    assert rows[1]["dropped"] == [] and rows[1]["accepted"] == [0, 1, 2]
    assert killed["noticed"] < KILL_TIMEOUT_S  # the launcher watched (a stale heartbeat: 60 s)
    assert not [p for p in killed["pids"] if workers._alive(p)]  # none outlived its group
    assert set(ranks[(1, 1)]).isdisjoint(killed["pids"])  # a fresh group for client 1
    later = [(1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert sorted(ranks) == [(1, 0), *later]
    assert {ranks[k] for k in later} == {ranks[(1, 1)]}  # then kept for every later client


def test_fsdp_client_on_a_bf16_base_is_exact(bert_no_dropout, tiny_csv, tmp_path):
    """FSDP with a bf16 base (its residuals in the fp32 side branch, sharded): exact."""
    cfg = _cfg(bert_no_dropout, tiny_csv, distributed="fsdp", dtype="bf16")
    rows = run_experiment(cfg, tmp_path, progress=False)
    assert [r["accepted"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    group = workers.WorkerGroup(cfg, "fedex")
    pids = [*group.rank_pids(), group.launcher_pid()]
    assert len(pids) == 3 and all(workers._alive(p) for p in pids)  # it trained on the group
    from fedexlora.bridge.adapters import lora_layers

    bases = {x.get_base_layer().weight.dtype for x in lora_layers(_verify().fresh(cfg)).values()}
    assert bases == {torch.bfloat16}
    err = model_vs_ideal(cfg, tmp_path)
    print(f"fsdp (bf16 base): model vs ideal {err:.3e}")
    assert err <= 1e-5
    # stopped, its ranks leave at once (the interpreter's teardown skipped: 2.5-7 s a rank
    # under load before), and nothing outlives the group
    start = time.monotonic()
    group.stop()
    took = time.monotonic() - start
    print(f"group stopped in {took:.2f} s")
    assert took < STOP_S and not [p for p in pids if workers._alive(p)]
