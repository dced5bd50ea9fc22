"""Centralized LoRA: every client's examples pooled in one party; the upper reference."""

from __future__ import annotations

from fedexlora.core.methods.spec import MethodSpec


def check(cfg) -> list[str]:
    """The pooled baseline has no clients: no per-client privacy budgets."""
    if cfg.dp:
        return [
            "`dp_epsilon`: DP-SGD cannot be combined with method 'centralized' (it has no "
            "clients to hold budgets)"
        ]
    return []


SPEC = MethodSpec(
    name="centralized",
    title="Centralized LoRA",
    paper="Hu et al., ICLR 2022 (arXiv 2106.09685): LoRA on the pooled data",
    trains="A and B, on every client's examples pooled",
    keeps_local="everything (one party)",
    uploads="nothing",
    downloads="nothing",
    exact=True,
    linear=True,
    bytes_per_round="0",
    federated=False,
    server_method="fedex",  # one client holding all the data: its server is FedEx's
    flower=False,
    check=check,
)
