"""HetLoRA (Cho et al., EMNLP 2024): sparsity-weighted aggregation of zero-padded uploads,
the plain truncation for lower-rank clients, and rank self-pruning, each against a
computation by hand, then end to end on both engines."""

import torch
from safetensors.torch import load_file

from fedexlora.bridge.adapters import get_state
from fedexlora.bridge.fold import effective_weight
from fedexlora.bridge.layers import lora_layers
from fedexlora.core.aggregation import aggregate
from fedexlora.core.messages import ClientUpload
from fedexlora.run.inprocess import run_experiment
from fedexlora.server import Server
from test_paper_methods import _factors, _two_rank_model


def test_hetlora_weights_by_the_norm_of_each_update_and_ignores_data_weights():
    As, Bs, p = _factors(k=4, r=3)
    As[0][2:] = 0  # a zero-padded rank-2 client
    Bs[0][:, 2:] = 0
    res = aggregate(As, Bs, p, method="hetlora")
    norms = torch.stack([torch.linalg.norm(B @ A) for A, B in zip(As, Bs)])  # dense
    w = norms / norms.sum()
    assert torch.allclose(res.A, sum(wi * A for wi, A in zip(w, As)), atol=1e-12)
    assert torch.allclose(res.B, sum(wi * B for wi, B in zip(w, Bs)), atol=1e-12)
    other = aggregate(As, Bs, [1.0] * 4, method="hetlora")  # the data weights do not matter
    assert torch.allclose(other.A, res.A, atol=1e-12) and res.residual.is_zero


def test_hetlora_lower_rank_client_gets_the_first_rows_and_keeps_its_cut(tiny_bert_dir):
    model, glob, low = _two_rank_model(tiny_bert_dir)
    g = torch.Generator().manual_seed(1)
    server = Server(get_state(model, adapter="default"), glob, num_clients=3, method="hetlora",
                    client_layers={1: low})  # fmt: skip
    pay = server.payload_for(1)
    assert not pay.residuals  # the rest of the global adapter is dropped, not folded
    root = (glob[next(iter(glob))].scale / low[next(iter(low))].scale) ** 0.5
    for name, (A, B) in pay.state.factors.items():
        gA, gB = server.state.factors[name]
        assert torch.allclose(A, gA[:2] * root) and torch.allclose(B, gB[:, :2] * root)
    server.payload_for(0)
    server.payload_for(2)
    # client 0 (rank 4) pruned itself to rank 3: its zero tail is kept from then on, though
    # client 2's full rank gives the global adapter a tail
    ups = []
    for c, (st, r) in ((0, (server.state, 3)), (1, (pay.state, 2)), (2, (server.state, 4))):
        factors = {}
        for k, (A, B) in st.factors.items():
            A, B = (
                A + 0.1 * torch.randn(A.shape, generator=g),
                B + 0.1 * torch.randn(B.shape, generator=g),
            )
            A[r:], B[:, r:] = 0, 0
            factors[k] = (A, B)
        ups.append(ClientUpload(c, type(st)(factors=factors, extra=st.extra), 10))
    server.aggregate(ups)
    assert server.client_rank == {0: 3}
    nxt = server.payload_for(0)
    for A, B in nxt.state.factors.values():
        assert not A[3:].any() and not B[:, 3:].any() and A[:3].any()
    assert all(A[3:].any() for A, _ in server.state.factors.values())
    assert all(A[3:].any() for A, _ in server.payload_for(2).state.factors.values())
    again = Server(get_state(model, adapter="default"), glob, num_clients=3, method="hetlora",
                   client_layers={1: low})  # fmt: skip
    again.load_state_dict(server.state_dict())
    assert again.client_rank == {0: 3}


def test_hetlora_end_to_end_prunes_and_matches_on_both_engines(
    tiny_cfg, tmp_path, task_identity, monkeypatch
):
    """Ranks 2, 4, 4 with a strong pruning weight: some client cuts its rank, keeps it cut,
    and the model is the sparsity-weighted average of the zero-padded uploads."""
    import fedexlora.core.methods.hetlora as hetlora
    from test_flower import _final_model
    from test_flower_parity import _close, _flower
    from test_precision import _rel, _w0

    monkeypatch.setattr(hetlora, "LAMBDA", 20.0)
    cfg = tiny_cfg.replace(methods=["hetlora"], rounds=3, lora_r=4, client_ranks=[2, 4, 4],
                           lr=2e-2, save_client_adapters=True)  # fmt: skip
    local = run_experiment(cfg, tmp_path / "local", progress=False)
    model, server = _final_model(cfg, tmp_path / "local", "hetlora")
    assert server.client_rank, "no client pruned its rank"
    last = tmp_path / "local" / "clients" / f"round-{cfg.rounds}"
    tensors = [  # each client's own adapter (another rank's is saved under rank<r>/)
        load_file(str(last / f"client-{c}" / ("" if r == 4 else f"rank{r}")
                      / "adapter_model.safetensors"))
        for c, r in enumerate(cfg.client_ranks)
    ]  # fmt: skip
    s_g = cfg.lora_alpha / cfg.lora_r
    got, want, w0 = {}, {}, {}
    for n, layer in lora_layers(model).items():
        padded = []
        for c, t in enumerate(tensors):
            key = next(k for k in t if k.endswith(f"{n.removeprefix('base_model.model.')}"
                                                  ".lora_A.weight"))  # fmt: skip
            A, B = t[key].double(), t[key.replace("lora_A", "lora_B")].double()
            r_c = cfg.client_ranks[c]
            A_p = torch.zeros(4, A.shape[1], dtype=A.dtype)
            B_p = torch.zeros(B.shape[0], 4, dtype=B.dtype)
            f = (cfg.lora_alpha / r_c) / s_g  # the client's scale, in the global one
            A_p[:r_c], B_p[:, :r_c] = A * f**0.5, B * f**0.5
            padded.append((A_p, B_p))
        norms = torch.stack([torch.linalg.norm(B @ A) for A, B in padded])
        w = norms / norms.sum()
        A_g = sum(wi * A for wi, (A, _) in zip(w, padded))
        B_g = sum(wi * B for wi, (_, B) in zip(w, padded))
        w0[n] = _w0(layer)
        want[n] = w0[n] + s_g * B_g @ A_g
        got[n] = effective_weight(layer).double()
    assert _rel(got, want, w0) <= 1e-5
    for c, r in server.client_rank.items():  # its last upload used only the cut rank
        for k, t in tensors[c].items():
            if k.endswith("lora_A.weight"):
                assert not t[r:].any() and t[:r].any(), (c, k)
    assert min(r["effective_deviation"]["max"] for r in local) > 1e-3  # lossy, and reported
    flower, _ = _flower(cfg, tmp_path / "flower")
    _close(flower, local)
    other, other_server = _final_model(cfg, tmp_path / "flower", "hetlora")
    assert other_server.client_rank == server.client_rank
    for n, layer in lora_layers(other).items():
        assert torch.allclose(effective_weight(layer).double(), got[n], rtol=0, atol=1e-6), n
