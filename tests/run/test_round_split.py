"""Every round's row says where its seconds went, on both engines, measured where spent.

``split_seconds`` (:mod:`fedexlora.run.timing`): the clients' training steps (their sum
and the longest), their set-up and reset, the evaluation, the server's aggregation, the
outcome applied to the global model, the checkpoint, and the round's wall time. The
parts are timed around the calls that do the work, so a step made slow on purpose shows
up in its own part and in no other: that is what fails when a timer is removed or put
around the wrong call. Bounds compare with the delay the test itself adds, never a
machine's speed.
"""

from __future__ import annotations

import time

import pytest
import torch

from fedexlora.run.inprocess import run_experiment
from fedexlora.run.report import read_metrics
from test_flower import InProcessGrid

PARTS = {"total", "train", "train_max", "train_wall", "setup", "evaluate", "aggregate", "apply",
         "checkpoint"}  # fmt: skip
SUMMED = ("train", "setup", "evaluate", "aggregate", "apply", "checkpoint")


def _flower(cfg, run_dir):
    from fedexlora.flower.client_app import make_client_app
    from fedexlora.flower.records import resolve_run_config, to_run_config
    from fedexlora.flower.server_app import run_server

    rc = to_run_config(cfg, run_dir=str(run_dir))
    grid = InProcessGrid(make_client_app(rc), cfg.num_clients)
    run_server(grid, *resolve_run_config(rc), say=lambda *_: None)
    return read_metrics(run_dir / "metrics.jsonl")


def _run(engine, cfg, run_dir):
    if engine == "flower":
        return _flower(cfg, run_dir)
    run_experiment(cfg, run_dir, progress=False)
    return read_metrics(run_dir / "metrics.jsonl")  # what the file holds, not the objects


def _check_split(row):
    split = row["split_seconds"]
    assert set(split) == PARTS, row["round"]
    assert all(isinstance(v, float) and v >= 0 for v in split.values()), split
    assert split["train"] > 0 and split["evaluate"] > 0 and split["checkpoint"] > 0, split
    assert split["train_max"] <= split["train"] + 1e-9, split
    # clients one after another: the wall seconds in which one trained are their sum
    assert split["train_wall"] == pytest.approx(split["train"], rel=1e-3, abs=1e-3), split
    assert split["total"] >= row["seconds"], split
    # the clients train in turn here (in-process; the grid runs them one after another):
    # each second counted once, so the parts fit in the wall time
    assert sum(split[p] for p in SUMMED) <= split["total"] * 1.02 + 0.01, split
    assert split["aggregate"] == row["server_seconds"]


@pytest.mark.parametrize("engine", ["local", "flower"])
def test_every_row_splits_its_seconds_and_the_parts_fit_in_the_round(
    engine, tiny_cfg, tmp_path, task_identity
):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=2)
    rows = _run(engine, cfg, tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        _check_split(row)
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "Where the seconds went" in summary
    total = sum(r["split_seconds"]["total"] for r in rows)
    assert f"| fedex | {sum(r['split_seconds']['train'] for r in rows):.1f} | " in summary
    assert f" | {total:.1f} | " in summary


# each step made slow, where it is patched, and the part its seconds must show up in
SLOW = {
    "fedexlora.run.client_step.train_local": "train",
    "fedexlora.run.client.SharedModel.apply": "setup",  # in-process
    "fedexlora.run.client.OwnModel.apply": "setup",  # a Flower client's own model
    "fedexlora.run.client_step.trained_upload": "setup",
    "fedexlora.run.rounds._test_metrics": "evaluate",
    "fedexlora.run.rounds.apply_outcome": "apply",
    "fedexlora.run.lifecycle.save_checkpoint": "checkpoint",
    "fedexlora.server.aggregation.Aggregation._commit": "aggregate",
}


def _slowed(monkeypatch) -> dict[str, list]:
    """Makes each call of every :data:`SLOW` target take its own number of seconds.

    ``time.perf_counter`` becomes a clock that stands still except inside a target,
    where it moves on by that target's delay (a distinct power of two): every timer then
    reads exactly the delays of the slow calls it is around, and nothing else, whatever
    the machine's load. Returns target -> ``[delay, calls]``.
    """
    import importlib

    now = [1000.0]
    seen: dict[str, list] = {}
    for i, target in enumerate(SLOW):
        path, name = target.rsplit(".", 1)
        try:
            owner = importlib.import_module(path)
        except ModuleNotFoundError:  # a class's method
            mod, cls = path.rsplit(".", 1)
            owner = getattr(importlib.import_module(mod), cls)
        seen[target] = [float(2**i), 0]
        monkeypatch.setattr(owner, name, _slow(getattr(owner, name), seen[target], now))
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "time", lambda: now[0])  # the clients' training spans
    return seen


def _slow(real, seen: list, now: list):
    def slow(*args, **kwargs):
        seen[1] += 1
        now[0] += seen[0]
        return real(*args, **kwargs)

    return slow


@pytest.mark.parametrize("engine", ["local", "flower"])
def test_each_part_is_timed_around_its_own_calls_and_no_other(
    engine, tiny_cfg, tmp_path, monkeypatch, task_identity
):
    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1)
    seen = _slowed(monkeypatch)
    split = _run(engine, cfg, tmp_path / "run")[0]["split_seconds"]
    want = dict.fromkeys(SUMMED, 0.0)
    for target, (delay, calls) in seen.items():
        want[SLOW[target]] += delay * calls
    holder = "OwnModel" if engine == "flower" else "SharedModel"
    assert seen[f"fedexlora.run.client.{holder}.apply"][1] == cfg.num_clients
    assert seen["fedexlora.run.client_step.train_local"][1] == cfg.num_clients
    assert all(calls >= 1 for t, (_, calls) in seen.items() if "Model.apply" not in t)
    assert {p: split[p] for p in SUMMED} == pytest.approx(want, abs=1e-9)
    assert split["total"] == pytest.approx(sum(want.values()), abs=1e-9)
    # each client's own training: the longest holds one client's delay, not three
    assert split["train_max"] == pytest.approx(seen["fedexlora.run.client_step.train_local"][0])
    # one after another (a Flower client's span from its reply): the wall holds all three
    assert split["train_wall"] == pytest.approx(want["train"], abs=1e-9)


def test_clients_training_in_parallel_count_their_common_seconds_once():
    from fedexlora.run.timing import RoundClock

    clock = RoundClock()
    for span in [(10.0, 12.0), (11.0, 13.0), (15.0, 16.0), (15.25, 15.75)]:
        clock.add_span(*span)  # two clients at once, then one alone (and one inside it)
    for c, s in enumerate([2.0, 2.0, 1.0, 0.5]):
        clock.add("train", s, c)
    split = clock.split(aggregate=0.0, total=7.0)
    assert split["train_wall"] == pytest.approx(4.0) and split["train"] == pytest.approx(5.5)
    assert clock.train_span() == (10.0, 16.0)
    with pytest.raises(ValueError, match="must run forward in time"):
        clock.add_span(3.0, 2.0)


def test_flower_clients_under_dp_send_no_seconds_and_the_row_says_not_measured():
    from fedexlora.run.timing import RoundClock

    clock = RoundClock()
    clock.clients_measured = False
    split = clock.split(aggregate=0.1, total=1.0)
    assert split["train"] is None and split["train_max"] is None and split["setup"] is None
    assert split["train_wall"] is None
    assert split["total"] == 1.0 and split["aggregate"] == 0.1


def test_a_phase_outside_a_clock_records_nothing_and_nested_phases_count_once():
    from fedexlora.run.timing import RoundClock, phase, running

    with phase("train"):  # no clock: nothing to record, nothing raised
        pass
    clock = RoundClock()
    with running(clock):
        with phase("setup"):
            time.sleep(0.05)
            with phase("train", client=3):
                time.sleep(0.1)
    assert 0.1 <= clock.seconds["train"] < 0.15 + 0.1
    assert 0.05 <= clock.seconds["setup"] < 0.1 + 0.1  # the inner 0.1 s is not counted twice
    assert clock.train_by_client == {3: clock.seconds["train"]}
    with pytest.raises(ValueError, match="unknown part 'trian' of a round's time"):
        clock.add("trian", 1.0)


def test_the_summary_table_sums_each_methods_rounds_and_says_what_was_not_measured():
    from fedexlora.run.report import time_split_table

    def split(train, total, **kw):
        parts = dict(train=train, train_max=train, setup=0.5, evaluate=1.0, aggregate=0.25,
                     apply=0.25, checkpoint=0.5, total=total)  # fmt: skip
        return {**parts, **kw}

    rows = [
        {"method": "fedex", "round": 1, "split_seconds": split(4.0, 8.0)},
        {"method": "fedex", "round": 2, "split_seconds": split(2.0, 6.0)},
        {"method": "fedit", "round": 1, "split_seconds": split(None, 5.0, setup=None)},
        {"method": "old", "round": 1},  # a row written before the split: no line
        # clients in parallel: 4 s of steps in 2 s of the round's wall time
        {"method": "par", "round": 1, "split_seconds": split(4.0, 6.0, train_wall=2.0)},
    ]
    header, cells = time_split_table(rows)
    assert header[-3:] == ["other", "total", "total / (training + evaluate)"]
    # fedex: train 6, setup 1, evaluate 2, aggregate 0.5, apply 0.5, checkpoint 1 = 11 of 14
    assert cells[0] == ["fedex", "6.0", "1.0", "2.0", "0.5", "0.5", "1.0", "3.0", "14.0", "1.75"]
    assert cells[1] == ["fedit", "n/a", "n/a", "1.0", "0.2", "0.2", "0.5", "3.0", "5.0", "n/a"]
    assert cells[2][-1] == "2.00"  # 6 / (2 + 1): the round over its training's wall seconds
    assert len(cells) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_frozen_digest_sees_one_flipped_bit_anywhere(dtype):
    """The apply step's frozen-parameter check, made cheaper, still sees any changed bit."""
    from fedexlora.bridge.whole import _checksum, _digest

    g = torch.Generator().manual_seed(0)
    t = torch.randn(3000, generator=g).to(dtype)
    before = _digest(t)
    assert _digest(t.clone()) == before
    for i in (0, 1234, 2999):  # the lowest bit of one element: the smallest change there is
        bits = t.clone().view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        bits[i] ^= 1
        assert _digest(bits.view(dtype)) != before, i
    # off the CPU it is the checksum, which sees the change too
    assert _checksum(bits.view(dtype)) != _checksum(t)


def test_the_round_time_benchmark_reports_the_goals_ratios_from_the_rows():
    from conftest import load_script

    bench = load_script("benchmarks/round_time.py")
    row = dict(round=2, metric=0.5, train=6.0, train_max=3.0, setup=0.5, evaluate=2.0,
               aggregate=0.25, apply=0.25, checkpoint=0.5, total=10.0)  # fmt: skip
    assert bench.ratios(row) == {"other": 0.5, "ratio": 1.25, "ratio_wall": 1.25}
    assert bench.ratios({**row, "train_wall": 3.0})["ratio_wall"] == 2.0
    dp = {**row, "train": None, "train_max": None, "setup": None}
    assert bench.ratios(dp) == {"other": 7.0}
    mem = {"wall": 1.0, "peak_rss_clients": 0, "peak_rss_by_name": {"fedexlora": 10**9},
           "sampler_cpu": 0.1}  # fmt: skip
    local = {"engine": "local", "rows": [row, row], "peak_rss": 10**9, "peak_pss": 10**9, **mem}
    flower = {**local, "engine": "flower", "rows": [dp], "peak_rss": 4 * 10**9}
    flower.update(peak_rss_clients=2 * 10**9, peak_pss=3 * 10**9, peak_pss_clients=10**9)
    assert "| local | 2 | 0.5000 | 6.00 | 3.00 |" in bench.table([local, flower])
    text = bench.summary([local, flower])
    assert "round / (train + eval) 1.250, round / (train_wall + eval) 1.250" in text
    assert "peak PSS 3000 MB (3.00x in-process), its virtual clients 1000 MB (1.00x" in text
    assert "peak RSS 4000 MB (4.00x in-process), its virtual clients 2000 MB (2.00x" in text
    assert "the memory sampler's CPU 0.1 s (10.0% of one core)" in text


def test_the_memory_sampler_reads_pss_at_its_own_cadence_and_counts_its_cpu():
    """RSS every ``every`` s, PSS (the costly ``smaps_rollup``) every ``pss_every`` s:
    a child that takes 150 MB after 1 s shows in the RSS peak, and in the PSS peak only
    when PSS is read after it. The sampler's own CPU seconds come back."""
    import subprocess
    import sys

    from conftest import load_script

    mem = load_script("benchmarks/proc_memory.py")
    child = [sys.executable, "-c", "import time; time.sleep(1); b = bytearray(150 * 2**20); "
             "b[::4096] = b'x' * len(b[::4096]); time.sleep(2)"]  # fmt: skip
    for pss_every, sees_it in ((0.5, True), (60.0, False)):
        done, peaks, wall = mem.run_sampled(
            child, {}, stdout=subprocess.PIPE, every=0.1, pss_every=pss_every
        )
        assert done.returncode == 0, done.stdout
        assert peaks.rss > 150 * 2**20, peaks
        assert (peaks.pss > 150 * 2**20) is sees_it, (pss_every, peaks)
        assert 0 < peaks.sampler_cpu < wall, peaks
