"""FlexLoRA with heterogeneous ranks: a lower-rank client starts from the factors the
authors' release gives it (alibaba/FederatedScope, branch FlexLoRA,
``fed_utils/adaptive_peft.py``, ``distribute_weight_fast``): with the global update
``ΔW = s_g B̄ Ā = U Σ Vᵀ``, ``A = V_rᵀ`` (orthonormal rows) and ``B = U_r Σ_r / s_i`` at
the client's own LoRA scale ``s_i``. Checked against a dense ``torch.linalg.svd``, on the
factors themselves (sign-free) and on their product; FedEx and HetLoRA keep their own
ways of cutting."""

import math

import pytest
import torch

from fedexlora.core.hetero import client_view
from fedexlora.core.state import AdapterState, LayerInfo
from fedexlora.server import ClientUpload, Server

D, N, R = 24, 20, 8


def _info(r, rslora=False):
    return LayerInfo(
        scale=16 / (math.sqrt(r) if rslora else r), fan_in_fan_out=False, rank=r, shape=(D, N)
    )


def _global_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(R, N, generator=g, dtype=torch.float64)
    B = torch.randn(D, R, generator=g, dtype=torch.float64)
    return AdapterState(factors={"m": (A, B)})


def _dense_svd(state, scale):
    A, B = state.factors["m"]
    return torch.linalg.svd(scale * B.double() @ A.double(), full_matrices=False)


def _assert_release_form(A, B, U, S, Vh, r, s, atol):
    """``A = V_rᵀ`` and ``B = U_r Σ_r / s``, each component up to its sign."""
    A, B = A.double(), B.double()
    eye = torch.eye(r, dtype=torch.float64)
    assert torch.allclose(A @ A.T, eye, atol=atol)  # orthonormal rows
    assert torch.allclose(A @ Vh[:r].T, torch.diag(torch.diag(A @ Vh[:r].T)), atol=atol)
    sign = torch.diag(A @ Vh[:r].T)
    assert torch.allclose(sign.abs(), torch.ones(r, dtype=torch.float64), atol=atol)
    assert torch.allclose(A, sign[:, None] * Vh[:r], atol=atol)
    want_B = U[:, :r] * (S[:r] / s) * sign
    assert torch.allclose(B, want_B, atol=atol * float(S[0] / s))
    best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]  # and the product is the truncation
    assert torch.allclose(s * B @ A, best, atol=atol * float(S[0]))


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("r", [2, 4])
def test_client_view_gives_the_released_factors_at_the_clients_own_scale(r, rslora):
    state = _global_state()
    glob, low = {"m": _info(R, rslora)}, {"m": _info(r, rslora)}
    view, tail = client_view(state, glob, low, orthonormal_A=True)
    A, B = view.factors["m"]
    U, S, Vh = _dense_svd(state, glob["m"].scale)
    _assert_release_form(A, B, U, S, Vh, r, low["m"].scale, atol=1e-10)
    # what the truncation leaves out, in weight space
    rest = U[:, r:] @ torch.diag(S[r:]) @ Vh[r:]
    assert torch.allclose(tail["m"].to_dense(), rest, atol=1e-10)


def test_fedex_and_hetlora_keep_their_own_cut():
    """FedEx's heterogeneous ranks split the singular values evenly between A and B;
    HetLoRA's client gets the first r rows of A and columns of B."""
    state = _global_state()
    glob, low = {"m": _info(R)}, {"m": _info(2)}
    s_g, s_c = glob["m"].scale, low["m"].scale
    U, S, Vh = _dense_svd(state, s_g)
    A, B = client_view(state, glob, low)[0].factors["m"]
    root = (S[:2] / s_c).sqrt()
    assert torch.allclose(A.norm(dim=1), root, atol=1e-10)
    assert torch.allclose(B.norm(dim=0), root, atol=1e-10)
    A, B = client_view(state, glob, low, slices=True)[0].factors["m"]
    gA, gB = state.factors["m"]
    k = math.sqrt(s_g / s_c)
    assert torch.allclose(A, gA[:2] * k) and torch.allclose(B, gB[:, :2] * k)
    with pytest.raises(ValueError, match="`slices` and `orthonormal_A` are two ways to cut"):
        client_view(state, glob, low, slices=True, orthonormal_A=True)


def test_a_direction_the_update_does_not_use_starts_fresh():
    """Before any round (B = 0) the release starts each client from a fresh adapter: A
    rows drawn as peft draws them, B zero."""
    A0 = _global_state().factors["m"][0]
    state = AdapterState(factors={"m": (A0, torch.zeros(D, R, dtype=torch.float64))})
    g = torch.Generator().manual_seed(3)
    view, tail = client_view(
        state, {"m": _info(R)}, {"m": _info(2)}, orthonormal_A=True, generator=g
    )
    A, B = view.factors["m"]
    assert torch.count_nonzero(B) == 0
    assert all(torch.count_nonzero(t.to_dense()) == 0 for t in tail.values())
    assert bool((A.abs() > 0).all()) and float(A.abs().max()) <= 1 / math.sqrt(N)


@pytest.mark.parametrize("rslora", [False, True])
def test_flexlora_server_gives_a_low_rank_client_the_released_factors(rslora):
    """Through the server, after a round of FlexLoRA: ranks 2, 4 and 8 (the global rank);
    every client's factors are the release's, and nothing is folded."""
    ranks = [2, 4, 8]
    glob = {"m": _info(R, rslora)}
    layers = {c: {"m": _info(r, rslora)} for c, r in enumerate(ranks) if r < R}
    g = torch.Generator().manual_seed(1)
    A0 = torch.rand(R, N, generator=g) * 2 / math.sqrt(N) - 1 / math.sqrt(N)
    state = AdapterState(factors={"m": (A0, torch.zeros(D, R))})
    server = Server(state, glob, method="flexlora", num_clients=3, client_layers=layers)
    uploads = []
    for c in server.sample(1):
        A, B = server.payload_for(c).state.factors["m"]
        A = A + 0.3 * torch.randn(A.shape, generator=g)
        B = B + 0.3 * torch.randn(B.shape, generator=g)
        uploads.append(ClientUpload(c, AdapterState(factors={"m": (A, B)}), 10 * (c + 1)))
    server.aggregate(uploads)
    U, S, Vh = _dense_svd(server.state, glob["m"].scale)
    for c, r in enumerate(ranks):
        pay = server.payload_for(c)
        A, B = pay.state.factors["m"]
        s = (layers[c] if c in layers else glob)["m"].scale
        _assert_release_form(A, B, U, S, Vh, r, s, atol=1e-5)
        assert not pay.residuals  # the truncation and nothing else


def test_only_flexlora_takes_the_released_factors_and_slicing_excludes_them():
    import dataclasses

    from fedexlora.core.methods import REGISTRY

    assert {m for m, s in REGISTRY.items() if s.hetero_orthonormal_A} == {"flexlora"}
    with pytest.raises(ValueError, match="`hetero_orthonormal_A` needs `hetero_ranks`"):
        dataclasses.replace(REGISTRY["hetlora"], hetero_orthonormal_A=True)
