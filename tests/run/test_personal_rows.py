"""A personalized method's headline metric covers every client that has trained so far.

FedSA-LoRA has no global model: each round's row averages the own models of every client
that has trained in this run, not only this round's (``run.loop.run_rounds`` hands
``close_round`` the run's earlier rows). With a fraction below 1 a client sampled in an
earlier round and not in this one must still count.
"""

from fedexlora.run.inprocess import run_experiment
from fedexlora.run.rounds import personal_metrics


def test_fedsa_rows_count_every_client_trained_so_far_at_a_fraction(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(
        methods=["fedsa"], num_clients=4, fraction=0.5, rounds=3, local_steps=1, max_test=40
    ).validate()
    rows = run_experiment(cfg, tmp_path / "run", progress=False)
    trained: set[int] = set()
    gone_since = False  # some client trained earlier and is not in a later round
    for row in rows:
        gone_since |= bool(trained - set(row["accepted"]))
        trained |= set(row["accepted"])
        own = row["personalized"]
        assert {int(c) for c in own["clients"]} == trained, row["round"]
        per_client = {int(c): (m, own["test_examples"][c]) for c, m in own["clients"].items()}
        assert row["metrics"] == personal_metrics(per_client)
        assert row["test_examples"] == sum(own["test_examples"].values())
    assert gone_since  # the fraction left someone out: the case the rows must still count
    assert trained == {0, 1, 2, 3}
