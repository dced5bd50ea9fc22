"""FedEx-LoRA for DoRA (fedexlora.core.dora) against peft's own DoRA forward, fp64.

Each client's layer is a peft DoRA layer; its weight is read from peft's forward on the
identity. The global layer, given the averaged factors, the base ``Dbar W0 + s R`` and
the magnitude ``||T||``, must apply exactly the weighted mean of the clients' weights,
round after round; averaging factors and magnitudes (FedIT) does not.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fedexlora.core.dora import (
    dora_aggregate,
    dora_magnitude,
    dora_row_scale,
    dora_weight,
)

D, N, R, ALPHA = 6, 5, 2, 3.0
P = (3.0, 5.0, 8.0)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(N, D, bias=False)

    def forward(self, x):
        return self.fc(x)


def _dora(W0, A, B, m):
    """A peft DoRA layer holding exactly these tensors (fp64)."""
    torch.manual_seed(0)
    model = get_peft_model(
        _Net().double(),
        LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["fc"], use_dora=True),
    )
    layer = model.base_model.model.fc
    with torch.no_grad():
        layer.base_layer.weight.copy_(W0)
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B)
        layer.lora_magnitude_vector["default"].weight.copy_(m)
    return model, float(layer.scaling["default"])


def _peft_weight(model):
    with torch.no_grad():
        return model(torch.eye(N, dtype=torch.float64)).T  # rows: x @ W^T on the identity


def _rel(a, b):
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def test_dora_weight_is_peft_forward():
    g = torch.Generator().manual_seed(0)
    W0, A = (
        torch.randn(D, N, generator=g, dtype=torch.float64),
        torch.randn(R, N, generator=g, dtype=torch.float64),
    )
    B, m = (
        torch.randn(D, R, generator=g, dtype=torch.float64),
        torch.rand(D, generator=g, dtype=torch.float64) + 0.5,
    )
    model, s = _dora(W0, A, B, m)
    assert _rel(dora_weight(W0, A, B, m, s), _peft_weight(model)) < 1e-12


@pytest.mark.parametrize("rounds", [3])
def test_global_dora_layer_equals_mean_of_client_weights(rounds):
    g = torch.Generator().manual_seed(1)
    f64 = dict(generator=g, dtype=torch.float64)
    W0 = torch.randn(D, N, **f64)
    A, B = torch.randn(R, N, **f64) * 0.3, torch.zeros(D, R, dtype=torch.float64)
    m = dora_magnitude(W0, A, B, 1.0)  # peft's init: m = ||W0||
    _, s = _dora(W0, A, B, m)
    p = torch.tensor(P, dtype=torch.float64) / sum(P)
    for _ in range(rounds):
        clients = [  # each client's own training: any change of A, B and m
            (
                A + 0.3 * torch.randn(R, N, **f64),
                B + 0.3 * torch.randn(D, R, **f64),
                m * (1 + 0.2 * torch.randn(D, **f64)),
            )
            for _ in P
        ]
        T = sum(pi * _peft_weight(_dora(W0, *c)[0]) for pi, c in zip(p, clients))
        out = dora_aggregate(
            [dora_row_scale(W0, *c, s) for c in clients],
            [c[0] for c in clients],
            [c[1] for c in clients],
            list(P),
        )
        assert out.residual.rank <= (len(P) + 1) * R
        W1 = out.new_base(W0, s)
        m1 = dora_magnitude(W1, out.A, out.B, s)
        got = _peft_weight(_dora(W1, out.A, out.B, m1)[0])
        move = float(torch.linalg.norm(T - _peft_weight(_dora(W0, A, B, m)[0])))
        assert float(torch.linalg.norm(got - T)) / move < 1e-10
        # FedIT: the means of A, B and m on the old base are clearly off
        naive = _peft_weight(
            _dora(W0, out.A, out.B, sum(pi * c[2] for pi, c in zip(p, clients)))[0]
        )
        assert float(torch.linalg.norm(naive - T)) / move > 1e-2
        W0, A, B, m = W1, out.A, out.B, m1


def test_dora_aggregate_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="dora_aggregate: 1 scales, 2 A, 2 B"):
        dora_aggregate([torch.ones(D)], [torch.zeros(R, N)] * 2, [torch.zeros(D, R)] * 2)
