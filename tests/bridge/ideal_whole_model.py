"""A whole model's ideal after federated rounds, computed by hand in fp64 (a test helper).

Every parameter of the model is looked at, by every name a module holds it under (a tied
or replicated tensor under each of its holders):

- a LoRA layer's effective weight (base, side branch, ``s B A``) must be at
  ``M_t = M_{t-1} - s B̄ Ā + Σ_i p_i s B_i A_i`` (``M_0`` the freshly loaded model's),
  with ``B̄, Ā`` the global factors the round began from and ``p_i = n_i / Σ n``;
- a trained extra (a task head, ``modules_to_save``, ``bias="all"``) must be at
  ``Σ_i p_i x_i`` of the uploads, as the model reports it (``get_state``: a
  half-precision extra's fp32 master);
- every other (frozen) parameter must keep its bits, including one that shares its
  storage with a LoRA layer's base weight (a tied input embedding).

Nothing here reads the server's report or its residuals.
"""

from __future__ import annotations

import torch

from fedexlora.bridge.adapters import get_state
from fedexlora.bridge.fold import effective_weight
from fedexlora.bridge.layers import lora_layers

_LORA_TAGS = (".lora_A.", ".lora_B.", ".lora_embedding_", ".lora_magnitude_vector", ".fedex_")


def _own_bases(model) -> set[str]:
    """The parameter names of the LoRA layers' own base weights (and their biases)."""
    out = set()
    for name, layer in lora_layers(model).items():
        for sub, module in layer.named_modules():
            if module is layer.get_base_layer():
                out |= {f"{name}.{sub}.{p}" for p, _ in module.named_parameters(recurse=False)}
    return out


class WholeModelIdeal:
    """The hand-computed fp64 ideal of every parameter of a peft model, round by round.

    Args:
        model: The freshly loaded global model (``W0`` and the initial adapters).
    """

    def __init__(self, model: torch.nn.Module):
        layers = lora_layers(model)
        self.scale = {n: float(layer.scaling["default"]) for n, layer in layers.items()}
        self.eff0 = {n: effective_weight(layer).cpu() for n, layer in layers.items()}
        self.eff = dict(self.eff0)
        self.extra0 = {k: v.double() for k, v in get_state(model).extra.items()}
        self.extra = dict(self.extra0)
        own = _own_bases(model)
        self.frozen = {
            n: p.detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)
            if n not in own and not any(t in n for t in _LORA_TAGS) and n not in self.extra0
            and not p.requires_grad
        }  # fmt: skip

    def round(self, start, uploads) -> None:
        """Advances the ideal by one round.

        Args:
            start: The global adapter state the clients began the round from
                (``payload.state`` of a full payload, or ``server.state`` before
                ``aggregate``).
            uploads: The round's ``ClientUpload`` list (all accepted).
        """
        n = torch.tensor([float(u.num_examples) for u in uploads], dtype=torch.float64)
        p = n / n.sum()
        for name, s in self.scale.items():
            A0, B0 = (t.double() for t in start.factors[name])
            new = sum(
                p[i] * s * (u.state.factors[name][1].double() @ u.state.factors[name][0].double())
                for i, u in enumerate(uploads)
            )
            self.eff[name] = self.eff[name] - s * (B0 @ A0) + new
        for key in self.extra:
            self.extra[key] = sum(p[i] * u.state.extra[key].double() for i, u in enumerate(uploads))

    def deviations(self, model: torch.nn.Module) -> dict[str, float]:
        """Per parameter, how far ``model`` is from the ideal.

        LoRA layers and extras: ``||got - ideal|| / ||ideal - start||`` (relative to the
        update since ``W0``); frozen parameters: 0 when bit-identical, else infinity.
        """
        out = {}
        for name, layer in lora_layers(model).items():
            got, ideal = effective_weight(layer).cpu(), self.eff[name]
            den = float(torch.linalg.norm(ideal - self.eff0[name])) or 1.0
            out[name] = float(torch.linalg.norm(got - ideal)) / den
        extras = get_state(model).extra
        for key, ideal in self.extra.items():
            den = float(torch.linalg.norm(ideal - self.extra0[key])) or 1.0
            out[key] = float(torch.linalg.norm(extras[key].double() - ideal)) / den
        params = dict(model.named_parameters(remove_duplicate=False))
        for key, bits in self.frozen.items():
            got = params[key].detach()
            out[key] = 0.0 if torch.equal(got.to(bits.device), bits) else float("inf")
        return out

    def check(self, model: torch.nn.Module, tol: float = 1e-5) -> float:
        """The worst deviation; raises ``AssertionError`` naming the worst parameter."""
        dev = self.deviations(model)
        worst = max(dev, key=dev.get)
        assert dev[worst] <= tol, f"{worst}: {dev[worst]:.3g} off its ideal (tolerance {tol})"
        return dev[worst]


def federate(new_model, *, clients: int = 3, rounds: int = 3, size: float = 0.05, seed: int = 0):
    """Runs ``rounds`` FedEx-LoRA rounds through the public API; returns what to check.

    Each client "trains" by adding seeded noise of relative ``size`` to every trainable
    parameter (its LoRA factors and extras), in the parameter's own dtype, as any local
    loop would leave them. Client ``i`` weighs ``i + 1`` examples.

    Args:
        new_model: Makes a freshly loaded peft model (the same weights every call).

    Returns:
        ``(global_model, client_models, ideal, reports)``, every client at the final
        global model (its payload after the last round applied); ``reports`` are
        ``apply_outcome``'s per-layer figures, one dict per round.
    """
    from fedexlora import Server, apply_outcome, apply_payload, layer_info, make_upload

    g = torch.Generator().manual_seed(seed)
    global_model = new_model()
    ideal = WholeModelIdeal(global_model)
    server = Server(get_state(global_model), layer_info(global_model), num_clients=clients)
    models = [new_model() for _ in range(clients)]
    reports = []
    for rnd in range(1, rounds + 1):
        start = server.state.clone()
        uploads = []
        for i in server.sample(rnd):
            apply_payload(models[i], server.payload_for(i))
            with torch.no_grad():
                for p in models[i].parameters():
                    if p.requires_grad:
                        noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
                        scale = size * (float(p.detach().double().abs().mean()) or 1.0)
                        p.add_((noise * scale).to(p.dtype))
            uploads.append(make_upload(models[i], num_examples=i + 1, client_id=i))
        outcome = server.aggregate(uploads)
        reports.append(apply_outcome(global_model, server, outcome, uploads))
        ideal.round(start, uploads)
    for i, m in enumerate(models):  # every client brought to the final global model
        apply_payload(m, server.payload_for(i))
    return global_model, models, ideal, reports
