"""Guards that keep a figure true, each tested by what goes wrong without it.

1. DP-SGD's first step: the gradients Opacus computed must be one per example. A layer
   that sees the batch's tokens as rows (a mixture of experts routes tokens that way)
   gets one gradient per token; clipping those bounds no example's influence, so the
   epsilon in the log would be false. The run stops instead.
2. DP-SGD's sampling rate is a probability: a client with fewer examples than the batch
   size samples at rate 1, and its logged epsilon is that of rate 1.
3. FedEx's residual is factored at the smallest rank the clients allow: clients whose A
   is the heaviest client's (a shared A, a duplicate of it) add nothing to it.
4. A server that reads its base delta from the engine's model checks the model at the
   first read: a reset payload or a checkpoint made right after the round in which the
   record moved to the model is the server's record, not whatever the model holds.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

from fedexlora import Server, aggregate, apply_outcome, apply_payload, get_state, layer_info
from fedexlora.bridge.fold import effective_weight, folded_delta
from fedexlora.bridge.layers import lora_layers
from fedexlora.training.privacy import DPCheckError
from test_privacy import independent_epsilon
from test_scale import _hand_ideal, _model, _rel_gap, _uploads


# -- 1. one per-sample gradient per example ----------------------------------------------
class _TokensAsRows(torch.nn.Module):
    """A classifier whose one trainable layer sees ``(batch * tokens, d)``: every token a
    row, as a mixture of experts hands its routed tokens to an expert's linear layer."""

    def __init__(self, vocab: int = 50, d: int = 8, classes: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.embed.weight.data = torch.randn(vocab, d, generator=g)
        self.embed.weight.requires_grad_(False)  # frozen, as a base model's
        self.expert = torch.nn.Linear(d, classes)

    def forward(self, input_ids, attention_mask, labels):
        b, t = input_ids.shape
        h = self.embed(input_ids)  # (b, t, d)
        per_token = self.expert(h.reshape(b * t, -1)).reshape(b, t, -1)
        mask = attention_mask[..., None].float()
        logits = (per_token * mask).sum(1) / mask.sum(1)
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels))


def test_per_token_gradients_are_not_taken_for_per_example_ones():
    """Opacus gives the token-fed layer ``batch * tokens`` gradients, all of that first
    dimension, so DP-SGD would clip tokens and go on; the first step stops it, naming
    the layer and the batch."""
    from fedexlora.training.local import Encoded, train_local

    g = torch.Generator().manual_seed(1)
    data = Encoded(
        input_ids=[torch.randint(1, 50, (6,), generator=g).tolist() for _ in range(20)],
        labels=[i % 3 for i in range(20)],
        kind="classification",
        pad_id=0,
    )
    dp = SimpleNamespace(noise_multiplier=1.0, sample_rate=0.5, max_grad_norm=1.0)
    with pytest.raises(DPCheckError, match=r"no per-sample gradient \(for the \d+ examples of "
                       r"the first batch\) for 'expert\.weight', 'expert\.bias'"):  # fmt: skip
        train_local(_TokensAsRows(), data, dp=dp, steps=2, batch_size=10, progress=False)


# -- 2. a sampling rate of at most 1 -----------------------------------------------------
def test_a_client_smaller_than_the_batch_samples_at_rate_one(tiny_cfg, tmp_path):
    """Batch 128, more than the 120 training examples of all clients together: each
    client samples every example every step (rate 1, not 128/n), and the epsilon it logs
    is rate 1's by an independent accountant, within the budget and spending it."""
    import json

    from fedexlora.run.inprocess import run_experiment

    cfg = tiny_cfg.replace(methods=["fedex"], rounds=1, local_steps=2, batch_size=128,
                           dp_epsilon=8.0, dp_delta=1e-3)  # fmt: skip
    run_experiment(cfg, tmp_path, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    priv = rows[-1]["privacy"]
    assert set(priv["clients"]) == {"0", "1", "2"} and not priv["refused"]
    for cid, rec in priv["clients"].items():
        assert rec["sample_rate"] == 1.0, cid
        assert rec["steps"] == 2
        args = (rec["noise_multiplier"], 1.0, rec["steps"], priv["delta"])
        lo, hi = priv["orders"]  # the logged epsilon, recomputed at its own orders
        again = independent_epsilon(*args, orders=list(range(lo, hi + 1)))
        assert rec["epsilon"] == pytest.approx(again, rel=1e-9)
        assert 0.99 * 8.0 <= again <= 8.0  # the whole budget, at rate 1
        assert independent_epsilon(*args) <= 8.0 * (1 + 1e-9), (cid, args)


# -- 3. the residual's rank: nothing from clients that share the heaviest one's A --------
def _clients(k, d, r, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    As = [torch.randn(r, n, generator=g, dtype=torch.float64) / n**0.5 for _ in range(k)]
    Bs = [torch.randn(d, r, generator=g, dtype=torch.float64) / d**0.5 for _ in range(k)]
    return As, Bs


def _ideal_residual(As, Bs, w):
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    A_bar = sum(pi * A for pi, A in zip(p, As))
    B_bar = sum(pi * B for pi, B in zip(p, Bs))
    return sum(pi * B @ A for pi, A, B in zip(p, As, Bs)) - B_bar @ A_bar


def test_clients_sharing_one_a_give_a_zero_residual():
    """With A shared (frozen, as FFA-LoRA trains it), ``sum p_i B_i A = B̄ A``: nothing
    to fold and nothing to send, whatever the clients' B."""
    As, Bs = _clients(4, 40, 4, 30)
    As = [As[0]] * 4
    w = [1.0, 2.0, 3.0, 4.0]
    res = aggregate(As, Bs, weights=w)
    assert res.residual.is_zero and res.residual.nbytes == 0
    ideal = sum(wi / sum(w) * B @ A for wi, A, B in zip(w, As, Bs))
    torch.testing.assert_close(res.B @ res.A, ideal, rtol=0, atol=1e-12)  # exact without one


@pytest.mark.parametrize("same_b", [True, False], ids=["duplicate", "same-A-other-B"])
def test_a_client_with_the_heaviest_clients_a_adds_no_rank(same_b):
    """Client 1 has the heaviest client's A (and its B too, or another): the residual has
    the rank of the dense ideal, ``2 r`` (three clients' worth), and its bytes, not
    ``3 r``'s, and stays exact."""
    d, r, n = 40, 4, 30
    As, Bs = _clients(4, d, r, n)
    As[1] = As[0].clone()
    if same_b:
        Bs[1] = Bs[0].clone()
    w = [4.0, 1.0, 2.0, 3.0]  # client 0 the heaviest
    ideal = _ideal_residual(As, Bs, w)
    want = int(torch.linalg.matrix_rank(ideal))
    assert want == 2 * r
    R = aggregate(As, Bs, weights=w).residual
    assert R.is_factored and R.rank == want
    assert R.U.shape == (d, want) and R.nbytes == want * (d + n) * 8
    torch.testing.assert_close(R.to_dense(), ideal, rtol=0, atol=1e-12)


# -- 4. the model-held delta is checked at its first read ------------------------------
def test_a_reset_right_after_the_record_moved_to_a_wrong_model_is_the_record(tiny_bert_dir):
    """The record turns dense and moves to the model in some round; a new client joins
    before the next round (whose start would check the model too). The model given as
    the source folded nothing: the read warns, and the client gets the server's record."""
    glob, other = _model(tiny_bert_dir), _model(tiny_bert_dir)
    server = Server(get_state(glob), layer_info(glob), num_clients=6)
    server.delta_source = functools.partial(folded_delta, other)  # not the folding model

    base = {n: effective_weight(layer, lora=False) for n, layer in lora_layers(glob).items()}
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        for c in (0, 1, 2):
            server.payload_for(c)
        ups = _uploads(server, [0, 1, 2], gen)
        ideal, base = _hand_ideal(base, ups, server.layers)
        apply_outcome(glob, server, server.aggregate(ups, effective=False), ups)
        if server.outgrown:
            break
    assert server.outgrown, "the record never moved to the model: this checks nothing"
    fresh = _model(tiny_bert_dir)
    with pytest.warns(UserWarning, match="is not the server's record"):
        payload = server.payload_for(5)
        assert payload.reset
        apply_payload(fresh, payload)
        assert _rel_gap(fresh, ideal) <= 1e-6  # the record, not what that model holds
