"""FedSA-LoRA: A is shared and averaged; every client keeps its own B.

Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR
2025 (arXiv 2410.01463; code: Pengxin-Guo/FedSA-LoRA). A learns what the clients share
and B what is their own: clients train both, upload only ``A_i`` and receive ``Ā``, and
B never leaves the client. There is no global model (each client's is ``W0 + s B_i Ā``),
so the method is evaluated per client, on a test split drawn like its training data, and
its rows report no deviation from a global ideal. The release weights each client by the
samples it processed in the round, the same for every client at its configs' fixed step
count: ``fedsa`` weights clients uniformly unless the run says otherwise
(``--weighting examples``: by local dataset size).
"""

from __future__ import annotations

import torch

from fedexlora.core.factors import Residual
from fedexlora.core.methods.spec import MethodSpec


def aggregate(A, B, p, *, out_dtype=torch.float32, generator=None, atol=1e-6):
    """``Ā``; B is the server's own (clients send none, and keep theirs); no residual."""
    del out_dtype, generator, atol
    k, r, n = A.shape
    d = B.shape[1]
    A_new = torch.einsum("k,krn->rn", p, A)  # (r, n)
    return A_new, B[0].clone(), Residual.zero(d, n, dtype=A.dtype, device=A.device)


SPEC = MethodSpec(
    name="fedsa",
    title="FedSA-LoRA",
    paper="Guo et al., ICLR 2025 (arXiv 2410.01463)",
    trains="A and B (B and the task head stay on the client)",
    keeps_local="B_i and the task head (personalized: evaluated per client)",
    uploads="A_i",
    downloads="Ā",
    exact=False,
    linear=True,
    bytes_per_round="up 4krn; down 4krn",
    aggregate=aggregate,
    keeps=("B", "head"),
    weighting="uniform",
)
