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
    return {
        "method": method,
        "clients": k,
        "plain_up": ups[0].nbytes,
        "secure_up": len(masked[0]),
        "limbs": rnd.quant.limbs,
        "client_mask_s": mask_s / k,
        "client_keys_s": (client_s - mask_s) / k,  # setup, share-keys, unmask
        "server_s": server_s,
        "plain_server_s": plain_s,
    }


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
        "client: quantize+mask s | server: SecAgg+ + aggregate s | server: plain aggregate s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        cfg = RunConfig(
            model=args.model, methods=[m], lora_r=args.rank, num_clients=args.clients,
            secure_aggregation=True,
        )  # fmt: skip
        r = measure(cfg, m, args.clients)
        print(
            f"| {m} | {r['plain_up'] / 1e6:.3f} MB | {r['secure_up'] / 1e6:.3f} MB | "
            f"{r['secure_up'] / r['plain_up']:.1f}x | {r['limbs']} | {r['client_keys_s']:.3f} | "
            f"{r['client_mask_s']:.3f} | {r['server_s']:.3f} | {r['plain_server_s']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
