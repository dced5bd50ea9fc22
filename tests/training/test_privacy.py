"""DP-SGD on every client: the budget by an independent accountant, exactness on top."""

# opacus and dp-accounting are test dependencies ([test] extra): a missing one fails here
import dp_accounting  # noqa: F401, E402
import opacus  # noqa: F401, E402
import pytest
import torch

# slow: the test order puts it first (tests/conftest.py); its seconds, measured
pytestmark = pytest.mark.slow(seconds=11)


def independent_epsilon(noise_multiplier, sample_rate, steps, delta, orders=None):
    """Google's dp-accounting (its own RDP code; its default orders unless given), not Opacus."""
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant(orders=orders)
    event = dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
    acc.compose(dp_event.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


def test_vectorised_rdp_is_opacus_rdp_at_every_order():
    """Our one-pass RDP (all orders at once) against Opacus's loop, the accountant it
    replaces, and against dp-accounting's, over rates and noise from tiny to certain."""
    import numpy as np
    from dp_accounting import dp_event, rdp
    from opacus.accountants.analysis.rdp import compute_rdp

    from fedexlora.training.privacy import ORDERS, rdp_one_step

    cases = [(1e-3, 2.5), (0.01, 0.5), (0.2, 1.0), (0.5, 8.0), (0.99, 0.5), (1.0, 2.5)]
    for q, sigma in cases:  # each of Opacus's calls takes about 0.4 s here
        ours = rdp_one_step(q, sigma)
        ref = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(ORDERS)))
        assert np.allclose(ours, ref, rtol=1e-9, atol=1e-12), (q, sigma)
    for q, sigma in cases[1:3]:
        acc = rdp.RdpAccountant(orders=list(ORDERS))
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)))
        assert np.allclose(rdp_one_step(q, sigma), acc._rdp, rtol=1e-6, atol=1e-12), (q, sigma)
    assert (rdp_one_step(0.0, 1.0) == 0).all() and np.isinf(rdp_one_step(0.3, 0.0)).all()


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_noise_multiplier_spends_the_budget_by_an_independent_accountant(tiny_cfg, epsilon):
    from fedexlora.training.privacy import epsilon_spent, plan

    cfg = tiny_cfg.replace(dp_epsilon=epsilon, dp_delta=1e-4, rounds=5, local_steps=7)
    budgets = plan(cfg, [40, 90, 200])
    for b in budgets.values():
        assert b.planned_steps == 35 and b.sample_rate == pytest.approx(8 / [40, 90, 200][b.client])
        spent = independent_epsilon(b.noise_multiplier, b.sample_rate, b.planned_steps, 1e-4)
        assert spent <= epsilon * (1 + 1e-9), (b, spent)
        ours = epsilon_spent(b.noise_multiplier, b.sample_rate, b.planned_steps, 1e-4)
        assert 0.99 * epsilon <= ours <= epsilon  # the whole budget, no needless noise
        less = epsilon_spent(0.99 * b.noise_multiplier, b.sample_rate, b.planned_steps, 1e-4)
        assert less > epsilon  # 1% less noise would pass the budget


def test_dp_run_is_private_by_its_log_and_fedex_stays_exact(tiny_cfg):
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for
    from test_examples import _weights, hand_ideal

    uploads = []  # what the clients of the current round sent
    from fedexlora.run.client_step import local_update as real_update

    def keep(*args, **kwargs):
        uploads.append(real_update(*args, **kwargs))
        return uploads[-1]

    cfg = tiny_cfg.replace(dp_epsilon=3.0, dp_delta=1e-3, rounds=2, local_steps=4).validate()
    task = load_task_for(cfg)
    rows_by = {}
    for method in ("fedex", "fedit"):
        model, tok = new_model(cfg, task, method)
        w0 = _weights(model)
        prep = prepare(cfg, tok, task)
        history = []

        def after_round(row, srv, mdl, _hist=history):
            _hist.append((None, list(uploads)))
            uploads.clear()

        rows, model, _ = run_method(
            cfg, method, prep, progress=False, model=model, after_round=after_round,
            local_update=keep,
        )  # fmt: skip
        rows_by[method] = rows
        if method == "fedex":  # the global model is the ideal average of the DP uploads
            got, want = _weights(model), hand_ideal(w0, history, scale=cfg.lora_alpha / cfg.lora_r)
            err = max(
                float(torch.linalg.norm(got[n] - want[n]) / torch.linalg.norm(want[n] - w0[n]))
                for n in want
            )
            assert err < 1e-5, err
    sizes = [len(p) for p in prep.parts]
    for method, rows in rows_by.items():
        for r, row in enumerate(rows, start=1):
            priv = row["privacy"]
            assert priv["delta"] == 1e-3 and priv["accountant"] == "rdp" and not priv["refused"]
            assert set(priv["clients"]) == {"0", "1", "2"}
            for cid, rec in priv["clients"].items():
                assert rec["steps"] == 4 * r and rec["max_grad_norm"] == cfg.dp_max_grad_norm
                assert rec["sample_rate"] == pytest.approx(cfg.batch_size / sizes[int(cid)])
                args = (rec["noise_multiplier"], rec["sample_rate"], rec["steps"], priv["delta"])
                lo, hi = priv["orders"]  # the logged epsilon, recomputed at its own orders
                again = independent_epsilon(*args, orders=list(range(lo, hi + 1)))
                assert again == pytest.approx(rec["epsilon"], rel=1e-9)
                assert rec["epsilon"] <= cfg.dp_epsilon
                assert independent_epsilon(*args) <= cfg.dp_epsilon, (method, cid)
            assert priv["epsilon"] == max(c["epsilon"] for c in priv["clients"].values())
        assert rows[-1]["privacy"]["epsilon"] == pytest.approx(3.0, rel=0.01)  # all spent
    # DP changed training: the same run without DP ends elsewhere
    plain, _, _ = run_method(cfg.replace(dp_epsilon=None), "fedex", prep, progress=False)
    assert plain[-1]["deviation"] != rows_by["fedex"][-1]["deviation"]
    assert "privacy" not in plain[-1] and rows_by["fedex"][-1]["train_loss"] is None


def test_a_resume_past_the_plan_refuses_every_client(tiny_cfg, tmp_path):
    from fedexlora.run.inprocess import run_experiment
    from fedexlora.run.report import read_metrics

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=8.0, dp_delta=1e-3, rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    rows = run_experiment(cfg.replace(rounds=2), tmp_path, resume=True, progress=False)
    assert [r["round"] for r in rows] == [1, 2]
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert last["privacy"]["refused"] == [0, 1, 2] and last["accepted"] == []
    assert "privacy budget" in last["note"]
    summary = (tmp_path / "summary.md").read_text()
    assert "within epsilon 8 at delta 0.001" in summary
    assert "fedex, round 2: clients [0, 1, 2] were not trained" in summary
    assert last["metrics"] == rows[0]["metrics"]  # nothing trained: the model is unchanged
    for rec in last["privacy"]["clients"].values():  # the steps carried over the resume
        assert rec["steps"] == rec["planned_steps"] == 3
        assert rec["epsilon"] <= 8.0 * (1 + 1e-6)


def test_partial_participation_refuses_a_client_sampled_beyond_its_plan(tiny_cfg):
    from fedexlora.run.build import new_model, prepare
    from fedexlora.run.inprocess import run_method
    from fedexlora.run.restore import load_task_for
    from fedexlora.training.privacy import planned_rounds

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=8.0, dp_delta=1e-3, rounds=4,
                           fraction=0.34, local_steps=1).validate()  # fmt: skip
    assert planned_rounds(cfg) == 2  # 1 of 3 a round, 4 rounds: each client planned twice
    task = load_task_for(cfg)
    model, tok = new_model(cfg, task, "fedex")
    rows, _, _ = run_method(cfg, "fedex", prepare(cfg, tok, task), progress=False, model=model)
    times: dict[int, int] = {}
    for row in rows:
        (c,) = row["sampled"]
        times[c] = times.get(c, 0) + 1
        assert (c in row["privacy"]["refused"]) == (times[c] > 2)
        assert row["privacy"]["clients"][str(c)]["steps"] == min(times[c], 2)
    assert max(times.values()) > 2, "the seed must sample one client three times"


def test_under_flower_the_clients_account_and_the_server_records(
    tiny_cfg, tmp_path, task_identity, monkeypatch
):
    """The real ClientApp and strategy: each client plans, counts and refuses by itself;
    the rows equal the in-process engine's (same sampling, noise, refusals, epsilons)."""
    from fedexlora.flower.simulation import SEEDED_DP_CONSENT
    from fedexlora.run.inprocess import run_experiment

    monkeypatch.setenv(SEEDED_DP_CONSENT, "1")  # the nodes allow the seeded opt-in
    from fedexlora.run.rounds import DP_SEEDED
    from test_flower_parity import _close, _flower

    # seeded DP (the opt-in): both engines draw the same sampling and noise, bit for bit
    cfg = tiny_cfg.replace(methods=["fedex", "fedsb"], fedsb_rank=4, dp_epsilon=8.0,
                           dp_delta=1e-3, rounds=4, fraction=0.34, local_steps=1,
                           dp_reproducible=True)  # fmt: skip
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    flower, grid = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    for row in (*flower, *local):
        assert row["privacy"]["randomness"] == DP_SEEDED and row["train_loss"] is None
    assert (
        "not private against anyone who knows the seed"
        in (tmp_path / "local" / "summary.md").read_text()
    )
    refused = 0
    for f, loc in zip(flower, local):
        fp, lp = f["privacy"], loc["privacy"]
        assert fp["refused"] == lp["refused"] and f.get("note") == loc.get("note")
        refused += len(fp["refused"])
        for c, rec in lp["clients"].items():
            if c in fp["clients"]:  # the server knows only what a client reported
                assert fp["clients"][c] == pytest.approx(rec, rel=1e-12), (f["round"], c)
            else:
                assert rec["steps"] == 0, "a client that trained must have reported"
        for rec in fp["clients"].values():
            spent = independent_epsilon(
                rec["noise_multiplier"], rec["sample_rate"], rec["steps"], fp["delta"],
                orders=list(range(2, 256)),
            )  # fmt: skip
            assert spent == pytest.approx(rec["epsilon"], rel=1e-9) and spent <= 8.0
    assert refused >= 2, "the seed must sample a client past its plan (each method)"


def test_under_flower_a_resume_past_the_plan_keeps_it(tiny_cfg, tmp_path, task_identity):
    """Rounds 1-2 planned; the run is resumed to 3 with every Context lost (a new
    federation): each client takes back the plan it last reported and refuses."""
    from fedexlora.flower.client_app import make_client_app
    from test_flower import InProcessGrid
    from test_flower_parity import _flower

    cfg = tiny_cfg.replace(methods=["fedex"], dp_epsilon=4.0, dp_delta=1e-3, rounds=2,
                           local_steps=1)  # fmt: skip
    run = tmp_path / "run"
    first, _ = _flower(cfg, run, grid=InProcessGrid(make_client_app({}), 3))
    longer = cfg.replace(rounds=3)
    (run / "config.toml").write_text(longer.to_toml())
    rows, grid = _flower(longer, run, grid=InProcessGrid(make_client_app({}), 3), resume=str(run))
    last = rows[-1]["privacy"]
    assert rows[-1]["round"] == 3 and last["refused"] == [0, 1, 2]
    assert rows[-1]["accepted"] == [] and rows[-1]["metrics"] == rows[1]["metrics"]
    for c, rec in last["clients"].items():
        before = first[-1]["privacy"]["clients"][c]
        assert rec == before, c  # the same plan and steps: nothing more was spent
        assert rec["steps"] == rec["planned_steps"] == 2


def test_a_trainable_layer_with_buffers_is_named():
    from fedexlora.training.privacy import check_model

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"--dp-epsilon: Opacus cannot train 1 privately"):
        check_model(net)
    net[1].requires_grad_(False)
    check_model(net)


def test_delta_must_be_below_one_over_the_smallest_client():
    from fedexlora.training.privacy import check_delta

    check_delta(1e-3, [50, 999])
    with pytest.raises(ValueError, match=r"--dp-delta 0.05 must be below 1 / 50 = 0.02"):
        check_delta(0.05, [50, 999])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp-epsilon", "0"], "`--dp-epsilon` must be > 0"),
        (["--dp-epsilon", "1", "--dp-delta", "0"], "`--dp-delta` must be in (0, 1)"),
        (
            ["--dp-epsilon", "1", "--method", "fedsb", "--fedsb-init", "gradient"],
            "gradient reads the clients' examples without noise",
        ),
        (["--dp-epsilon", "1", "--method", "fedex,centralized"], "method 'centralized'"),
        (["--dp-epsilon", "1", "--gradient-checkpointing"], "--gradient-checkpointing"),
        (["--dp-epsilon", "1", "--dp-delta", "0.5"], "--dp-delta 0.5 must be below 1 /"),
        (["--dp-epsilon", "1e-9"], "--dp-epsilon 1e-09 at --dp-delta 1e-05 cannot be met"),
    ],
)
def test_bad_dp_input_is_one_line_and_exit_2(tiny_bert_dir, tiny_csv, tmp_path, extra, message):
    from typer.testing import CliRunner

    from fedexlora.cli import app

    res = CliRunner().invoke(
        app,
        ["run", "--model", tiny_bert_dir, "--task", tiny_csv, "--clients", "3", "--rounds", "1",
         "--local-steps", "1", "--min-partition-size", "5", "--max-length", "16",
         "--out", str(tmp_path / "run"), "--no-progress", *extra],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert "Traceback" not in res.output
    assert not (tmp_path / "run" / "config.toml").exists()  # refused before anything is written


def test_a_causal_lm_examples_dp_gradient_does_not_depend_on_its_batchmates():
    """DP-SGD clips each example's gradient to C; that bounds one record's influence only
    if its gradient is its own. transformers' causal-LM loss is the batch's token mean,
    under which an example's gradient scaled with its batchmates' lengths (0.33 beside a
    40-token example, 3.4 beside a 2-token one); the loss DP-SGD trains on is the mean
    of each example's own token mean."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedexlora.training.privacy import per_example_loss, wrap

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0))  # fmt: skip
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("lm_head")

    def own_gradient(other: int) -> torch.Tensor:
        width = max(4, other)
        ids = torch.zeros(2, width, dtype=torch.long)
        mask, labels = torch.zeros_like(ids), torch.full((2, width), -100)
        ids[0, :4] = torch.tensor([5, 6, 7, 8])
        ids[1, :other] = torch.arange(9, 9 + other) % 60 + 1
        for row, length in ((0, 4), (1, other)):
            mask[row, :length] = 1
            labels[row, :length] = ids[row, :length]
        gsm = wrap(model)
        per_example_loss(gsm, {"input_ids": ids, "attention_mask": mask,
                               "labels": labels}).backward()  # fmt: skip
        got = model.lm_head.weight.grad_sample[0].clone()
        gsm.to_standard_module()
        for p in model.parameters():
            p.grad, p.grad_sample = None, None
        return got

    # one example alone: its own token mean, which transformers' loss is too
    one = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
           "labels": torch.tensor([[-100, -100, 7, 8, 9]])}  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(per_example_loss(model, one), model(**one).loss)
    beside_short, beside_long = own_gradient(2), own_gradient(40)
    assert beside_short.norm() > 0
    torch.testing.assert_close(beside_long, beside_short, rtol=1e-4, atol=1e-7)
    # one label per example (a classifier): the model's own loss, already per example
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([1])}
    calls = []
    per_example_loss(lambda **kw: calls.append(kw) or type("O", (), {"loss": 1.0}), batch)
    assert calls == [batch]
