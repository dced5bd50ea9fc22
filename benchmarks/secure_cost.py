"""What secure aggregation costs: bytes up per client and seconds per round, per method.

For every method that runs under secure aggregation, on the real model and its default
LoRA targets: the bytes one client uploads in the clear and under SecAgg+ (its masked
vector: two or three 32-bit limbs per number, FedEx's products included), the seconds a
client spends quantizing and masking, the seconds the server spends on the protocol
(forwarding, summing, unmasking, decoding) and its aggregation from the sums, against
its plain aggregation of the same uploads. No training: each client's upload is the
global adapter plus noise, which is what the protocol's cost depends on (sizes, not
values). One process, one thread by default.

    python benchmarks/secure_cost.py                  # MiniLM, r = 8, 3 clients
    python benchmarks/secure_cost.py --clients 10 --methods fedex,fedit
    python benchmarks/secure_cost.py --llama          # FedEx at Llama-3-8B shapes, vs the floor
    python benchmarks/secure_cost.py --study          # the sketch's parameters, measured

FedEx's upload is also reported against the floor: ``k r (d + n)`` numbers per layer (what
the server must learn, ``Ā``, ``B̄`` and a residual of rank ``(k - 1) r``, from one sum)
plus the weight, loss and head every method sends, in the masked vector's own encoding
(the same limbs and clip count). ``--llama`` runs one SecAgg+ round of 10 clients (every
stage, the masks, the quantization) per Llama-3-8B layer shape (4096 x 4096 and
4096 x 14336, r = 16) on synthetic factors, without a model; the bytes are the masked
vectors' lengths. ``--study`` measures the sketch's error (the model against the ideal
``Σ p_i B_i A_i``, the residual folded) for oversampling choices, fp32 sketches on the
clients and a two-pass variant, against the dense products' error through the same
quantization (the masks cancel exactly, so they are left out there).
"""

from __future__ import annotations

import argparse
import time

import torch


def _uploads(server, rnd: int, k: int, seed: int = 0):
    from fedexlora.core.messages import ClientUpload
    from fedexlora.core.state import AdapterState

    g = torch.Generator().manual_seed(seed)
    template = server.upload_template(rnd)
    out = []
    for c in range(k):
        flat = {
            key: t + 1e-3 * torch.randn(t.shape, generator=g)
            for key, t in template.to_flat().items()
        }
        out.append(ClientUpload(c, AdapterState.from_flat(flat), 500 + 10 * c, 1.0))
    return template, out


def measure(cfg, method: str, k: int) -> dict:
    """One secure round and one plain round of ``method`` on ``k`` clients' uploads."""
    from fedexlora.run.build import new_model, new_server
    from fedexlora.run.restore import load_task_for
    from fedexlora.secagg.protocol import ClientSession
    from fedexlora.secagg.rounds import SecureRound, client_reply, client_session_reply

    task = load_task_for(cfg)
    model, _ = new_model(cfg, task, method)
    plain, secure = new_server(cfg, method, model), new_server(cfg, method, model)
    for s in (plain, secure):
        for c in range(k):
            s.payload_for(c)
    template, ups = _uploads(plain, 1, k)
    t0 = time.perf_counter()
    plain.aggregate(ups, effective=False)
    plain_s = time.perf_counter() - t0

    sessions = {c: ClientSession(c) for c in range(k)}
    keys_s = mask_s = 0.0  # the clients' time, spent inside the server's timed span

    def exchange(stage, msgs):
        nonlocal keys_s
        t = time.perf_counter()
        out = {c: client_session_reply(sessions[c], stage, m) for c, m in msgs.items()}
        keys_s += time.perf_counter() - t
        return out

    t0 = time.perf_counter()
    rnd = SecureRound(template, method, list(range(k)), seed=1)
    rnd.keys(exchange)
    setups, collect = rnd.setup(), rnd.session.collect()
    t = time.perf_counter()
    masked = {
        c: client_reply(sessions[c], setups[c], collect[c], up, seed=0, rnd=1)
        for c, up in enumerate(ups)
    }
    mask_s = time.perf_counter() - t
    sums = rnd.finish(masked, exchange)
    secure.aggregate_secure(sums, list(range(k)))
    server_s = time.perf_counter() - t0 - keys_s - mask_s
    client_s = keys_s + mask_s
    floor = None
    if rnd.layout.products:
        floor = _floor_bytes(template, k, rnd.quant.limbs)
    return {
        "method": method,
        "clients": k,
        "floor": floor,
        "plain_up": ups[0].nbytes,
        "secure_up": len(masked[0]),
        "limbs": rnd.quant.limbs,
        "client_mask_s": mask_s / k,
        "client_keys_s": (client_s - mask_s) / k,  # setup, share-keys, unmask
        "server_s": server_s,
        "plain_server_s": plain_s,
    }


def _floor_bytes(template, k: int, limbs: int) -> int:
    """The floor in the masked vector's encoding: ``k r (d + n)`` per layer, the head, the
    weight and loss, in ``limbs`` 32-bit limbs, and the clip count."""
    numbers = 2 + sum(
        t.numel() for key, t in template.to_flat().items() if key.startswith("extra.")
    )
    for A, B in template.factors.values():
        numbers += k * A.shape[0] * (A.shape[1] + B.shape[0])
    return 4 * (numbers * limbs + 1)


def llama(k: int = 10, r: int = 16) -> None:
    """FedEx's bytes up per client at Llama-3-8B layer shapes, one SecAgg+ round each."""
    from fedexlora.core.messages import ClientUpload
    from fedexlora.core.state import AdapterState
    from fedexlora.secagg.protocol import ClientSession
    from fedexlora.secagg.rounds import SecureRound, client_reply, client_session_reply

    print(f"Llama-3-8B layer shapes, r = {r}, {k} clients; bytes per client, layer and round")
    print(
        "| layer (d x n) | up, clear | up, SecAgg+ (sketch) | floor | vs floor | s, s2 | round s |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for d, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
        A0, B0 = torch.randn(r, n, generator=g) / n**0.5, torch.randn(d, r, generator=g) * 1e-2
        template = AdapterState(factors={"layer": (A0, B0)})
        ups = [
            ClientUpload(
                c,
                AdapterState(
                    factors={
                        "layer": (
                            A0 + 1e-3 * torch.randn(r, n, generator=g),
                            B0 + 1e-4 * torch.randn(d, r, generator=g),
                        )
                    }
                ),  # fmt: skip
                500 + 10 * c,
                1.0,
            )
            for c in range(k)
        ]
        sessions = {c: ClientSession(c) for c in range(k)}

        def exchange(stage, msgs, sessions=sessions):
            return {c: client_session_reply(sessions[c], stage, m) for c, m in msgs.items()}

        t0 = time.perf_counter()
        rnd = SecureRound(template, "fedex", list(range(k)), seed=1)
        rnd.keys(exchange)
        setups, collect = rnd.setup(), rnd.session.collect()
        masked = {
            c: client_reply(sessions[c], setups[c], collect[c], up, seed=0, rnd=1)
            for c, up in enumerate(ups)
        }
        rnd.finish(masked, exchange)
        secs = time.perf_counter() - t0
        (_, shape), = rnd.layout.sketches  # fmt: skip
        up = len(masked[0])
        floor = _floor_bytes(template, k, rnd.quant.limbs)
        print(
            f"| {d} x {n} | {ups[0].nbytes / 1e6:.3f} MB | {up / 1e6:.3f} MB | "
            f"{floor / 1e6:.3f} MB | {up / floor:.3f}x | {shape.s}, {shape.s2} | {secs:.1f} |",
            flush=True,
        )


def _quantized_sum(vectors, quant, seed=0):
    """The decoded sum of the clients' vectors through the two-limb quantization."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ints = sum(quant.encode(v.numpy(), rng)[0] for v in vectors) % 2**32
    return torch.from_numpy(quant.decode(ints, len(vectors)))


def _study_variant(ups, w, quant, plan, *, fp32=False, two_pass=False):
    """``(B̄ Ā + residual, shape)`` from the quantized sums of one variant."""
    from fedexlora.core.secure import SecureLayout, client_vector, read_sums
    from fedexlora.core.sketch import Sketch, sketch_matrices
    from fedexlora.core.state import AdapterState

    template = AdapterState(factors={"l": ups[0]})
    r, n = ups[0][0].shape
    d, k = ups[0][1].shape[0], len(ups)
    q = (k - 1) * r
    lin = SecureLayout.for_template(template, products=False)
    if plan is None:  # the dense products
        layout = SecureLayout.for_template(template, products=True)
        vecs = [client_vector(layout, AdapterState(factors={"l": f}), wi) for f, wi in zip(ups, w)]
        sums = read_sums(layout, _quantized_sum(vecs, quant), template)
        A_b, B_b = sums.means["l"]
        return sums.products["l"], None
    sh = plan.shape(d, n, r)
    om, psi = sketch_matrices(plan.seed, "l", sh)
    if two_pass:  # round 1: Ā, B̄; round 2: each client sketches (B_i - B̄)(A_i - Ā)
        vecs = [client_vector(lin, AdapterState(factors={"l": f}), wi) for f, wi in zip(ups, w)]
        A_b, B_b = read_sums(lin, _quantized_sum(vecs, quant, seed=1), template).means["l"]
        vecs = []
        for (A, B), wi in zip(ups, w):
            Ac, Bc = A.double() - A_b, B.double() - B_b
            L, Rt = (Ac.T, Bc.T) if sh.transposed else (Bc, Ac)
            Y, W = L @ (Rt @ om), (psi @ L) @ Rt
            one = torch.tensor([1.0], dtype=torch.float64)
            vecs.append(torch.cat([one, Y.reshape(-1), W.reshape(-1)]) * wi)
        total = _quantized_sum(vecs, quant)
        total = total[1:] / total[0]
        Y = total[: sh.m * sh.s].reshape(sh.m, sh.s)
        W = total[sh.m * sh.s :].reshape(sh.s2, sh.c)
        U, V = Sketch("l", sh, plan.seed, Y, W).residual(A_b * 0, B_b * 0, q)
        return B_b @ A_b + U @ V, sh
    layout = SecureLayout.for_template(template, products=True, sketch=plan)
    vecs = []
    for (A, B), wi in zip(ups, w):
        if not fp32:
            vecs.append(client_vector(layout, AdapterState(factors={"l": (A, B)}), wi))
            continue
        L, Rt = (A.T, B.T) if sh.transposed else (B, A)  # fp32 factors, fp32 sketches
        Y, W = L @ (Rt @ om.float()), (psi.float() @ L) @ Rt
        head = client_vector(lin, AdapterState(factors={"l": (A, B)}), wi)
        vecs.append(torch.cat([head, Y.double().reshape(-1) * wi, W.double().reshape(-1) * wi]))
    sums = read_sums(layout, _quantized_sum(vecs, quant), template)
    A_b, B_b = sums.means["l"]
    U, V = sums.sketches["l"].residual(A_b, B_b, q)
    return B_b @ A_b + U @ V, sh


def study() -> None:
    """The sketch's error by parameters, against the dense products' (same quantization)."""
    from fedexlora.core.sketch import SketchPlan
    from fedexlora.secagg.encoding import Quantization

    print("error of the model (B̄ Ā + residual) against Σ p_i B_i A_i, relative to the update")
    print("and to the residual; weights n_i / 2^20 (n_i = 500 + 37 i), two limbs over ±256")
    print("| cell | variant | s, s2 | numbers | vs dense | err / update | err / residual |")
    print("|---|---|---|---|---|---|---|")
    for d, n, k, r in [(384, 384, 3, 8), (1024, 1024, 10, 16), (1024, 4096, 10, 16)]:
        g = torch.Generator().manual_seed(d + n + k)
        A0, B0 = torch.randn(r, n, generator=g) / n**0.5, torch.randn(d, r, generator=g) * 1e-2
        ups = [
            (
                A0 + 1e-2 * torch.randn(r, n, generator=g) / n**0.5,
                B0 + 1e-3 * torch.randn(d, r, generator=g),
            )  # fmt: skip
            for _ in range(k)
        ]
        w = [(500 + 37 * i) / 2**20 for i in range(k)]
        p = torch.tensor(w, dtype=torch.float64) / sum(w)
        M = sum(pi * B.double() @ A.double() for pi, (A, B) in zip(p, ups))
        A_t = sum(pi * A.double() for pi, (A, _) in zip(p, ups))
        B_t = sum(pi * B.double() for pi, (_, B) in zip(p, ups))
        norms = float(torch.linalg.norm(M)), float(torch.linalg.norm(M - B_t @ A_t))
        quant = Quantization.for_clients(k)
        cell = f"{d}x{n} k={k} r={r}"

        def row(name, got, sh, cell=cell, norms=norms, M=M, dn=d * n):
            err = float(torch.linalg.norm(got - M))
            size = (
                f"{sh.s}, {sh.s2} | {sh.numbers} | {sh.numbers / dn:.3f}" if sh else f"- | {dn} | 1"
            )
            print(f"| {cell} | {name} | {size} | {err / norms[0]:.1e} | {err / norms[1]:.1e} |",
                  flush=True)  # fmt: skip

        row("dense products", *_study_variant(ups, w, quant, None))
        for over, extra in [(0, 10), (2, 10), (5, 10), (10, 0), (10, 5), (10, 10), (20, 10)]:
            plan = SketchPlan(k, 5, over=over, extra=extra)
            row(f"one-pass, over {over}, extra {extra}", *_study_variant(ups, w, quant, plan))
        plan = SketchPlan(k, 5, over=r + 10)  # s = k r + 10: sized for M, not the residual
        row("one-pass, s = kr + 10", *_study_variant(ups, w, quant, plan))
        plan = SketchPlan(k, 5)
        row("one-pass, fp32 sketches", *_study_variant(ups, w, quant, plan, fp32=True))
        row("two-pass (second round)", *_study_variant(ups, w, quant, plan, two_pass=True))


def main() -> None:
    from fedexlora.config import RunConfig
    from fedexlora.core.methods import REGISTRY
    from fedexlora.core.secure import secure_refusal

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--methods", default=None, help="comma list (default: every one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--llama", action="store_true", help="FedEx at Llama-3-8B shapes only")
    ap.add_argument("--study", action="store_true", help="the sketch's parameters only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.llama:
        llama()
        return
    if args.study:
        study()
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    able = [n for n, s in REGISTRY.items() if secure_refusal(s) is None]
    methods = args.methods.split(",") if args.methods else able
    print(
        f"{args.model}, r = {args.rank}, {args.clients} clients, {args.threads} thread(s); "
        "bytes per client per round, seconds per round"
    )
    print(
        "| method | up, clear | up, SecAgg+ | ratio | limbs | client: keys s | "
        "client: quantize+mask s | server: SecAgg+ + aggregate s | server: plain aggregate s | "
        "floor | vs floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        cfg = RunConfig(
            model=args.model, methods=[m], lora_r=args.rank, num_clients=args.clients,
            secure_aggregation=True,
        )  # fmt: skip
        r = measure(cfg, m, args.clients)
        print(
            f"| {m} | {r['plain_up'] / 1e6:.3f} MB | {r['secure_up'] / 1e6:.3f} MB | "
            f"{r['secure_up'] / r['plain_up']:.1f}x | {r['limbs']} | {r['client_keys_s']:.3f} | "
            f"{r['client_mask_s']:.3f} | {r['server_s']:.3f} | {r['plain_server_s']:.3f} | "
            + (
                f"{r['floor'] / 1e6:.3f} MB | {r['secure_up'] / r['floor']:.2f}x |"
                if r["floor"]
                else "- | - |"
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
