"""One rank of a client's worker group: ``torchrun ... -m fedexlora.run.worker_main JOBDIR``.

Started by :class:`fedexlora.run.workers.WorkerGroup` (through ``torchrun`` or
``accelerate launch``, which set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the master's
address). Each rank joins the process group (gloo on CPU, NCCL on GPU, its
``LOCAL_RANK`` device), loads the model once (:func:`fedexlora.run.build.new_model`),
prepares it for its mode (:mod:`fedexlora.training.distributed`: DDP or FSDP), and then
runs the jobs ``JOBDIR/jobs/<n>.json`` in order: the client's state is loaded (rank 0
reads it, :func:`~fedexlora.training.distributed.load_round_state` gives every rank its
part), the client trains (:func:`fedexlora.run.client_step.local_update`, with the
batches split over the ranks), and rank 0 writes the trained state and the round's
example count and loss to ``JOBDIR/results/<n>``. Rank 0 also keeps a heartbeat and
decides when the group stops (``JOBDIR/stop``: its coordinator's word, idle time, or the
starting process gone); every rank then leaves.

A rank that fails writes ``JOBDIR/error-rank<r>.txt`` and exits non-zero; the launcher
then tears the group down (the coordinator reports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from fedexlora.run.layout import write_atomic

POLL_S = 0.05


def _heartbeat(path: Path, every: float, stop: threading.Event) -> None:
    """Rank 0's heartbeat: ``path`` touched every ``every`` seconds, even while training."""
    while not stop.wait(every):
        with contextlib.suppress(OSError):
            path.write_text(str(time.time()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main(jobdir: str) -> int:
    """Runs one rank until the group stops; returns the exit code."""
    import torch
    import torch.distributed as dist

    from fedexlora.config import RunConfig
    from fedexlora.quiet import quiet_libraries

    quiet_libraries()
    root = Path(jobdir)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    (root / f"rank-{rank}.pid").write_text(str(os.getpid()))
    conf = json.loads((root / "config.json").read_text())
    cfg = RunConfig(**conf["cfg"])
    method, owner, idle_s = conf["method"], conf.get("owner_pid"), float(conf["idle_s"])
    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local_rank)  # "cuda" is now this rank's device
        cfg = cfg.replace(device="cuda")
    # idle ranks wait on the file system, not in a collective: the timeout bounds a round's
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=1800))
    try:
        return _serve(root, cfg, method, owner, idle_s, rank)
    except BaseException:
        write_atomic(root / f"error-rank{rank}.txt", traceback.format_exc().encode())
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _serve(root: Path, cfg, method: str, owner: int | None, idle_s: float, rank: int) -> int:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from fedexlora.config import RunConfig
    from fedexlora.run.build import new_model
    from fedexlora.run.client_step import local_update
    from fedexlora.run.restore import load_task_for
    from fedexlora.training import distributed as D
    from fedexlora.training.local import Encoded

    task = load_task_for(cfg)
    model, tokenizer = new_model(cfg, task, method)  # once: the group keeps it across rounds
    D.set_context(D.DistContext(mode=cfg.distributed))
    D.prepare_model(model)
    with open(root / "loads.log", "a") as f:
        f.write(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time()}) + "\n")
    dist.barrier()
    beat = threading.Event()
    if rank == 0:
        (root / "heartbeat").write_text(str(time.time()))
        threading.Thread(
            target=_heartbeat, args=(root / "heartbeat", 1.0, beat), daemon=True
        ).start()
        write_atomic(root / "ready", b"")
    seq, last = 1, time.monotonic()
    try:
        while True:
            job_file = root / "jobs" / f"{seq}.json"
            if job_file.exists():
                job = json.loads(job_file.read_text())
                data = Encoded(**json.loads((root / "data" / job["data"]).read_text()))
                state = load_file(str(root / "jobs" / f"{seq}.safetensors")) if rank == 0 else None
                D.load_round_state(model, state)
                run_cfg = RunConfig(**job["cfg"]).replace(device=cfg.device)
                up = local_update(
                    run_cfg, method, model, data, int(job["round"]), int(job["client"]),
                    steps=job["steps"], tokenizer=tokenizer,
                )  # fmt: skip
                flat = D.trained_state(model)
                if rank == 0:
                    tmp = root / "results" / f".{seq}.safetensors.tmp"
                    save_file({k: v.contiguous().cpu() for k, v in flat.items()}, str(tmp))
                    os.replace(tmp, root / "results" / f"{seq}.safetensors")
                    result = {"num_examples": int(up.num_examples), "loss": up.train_loss}
                    write_atomic(root / "results" / f"{seq}.json", json.dumps(result).encode())
                seq, last = seq + 1, time.monotonic()
                continue
            if (root / "stop").exists():
                return 0
            if rank == 0:  # rank 0 decides for all: every rank then sees the stop file
                if time.monotonic() - last > idle_s:
                    write_atomic(root / "stop", b"idle")
                elif owner is not None and not _alive(int(owner)):
                    write_atomic(root / "stop", b"owner gone")
            time.sleep(POLL_S)
    finally:
        beat.set()


def _leave(code: int) -> None:
    """Exits at once, without the interpreter's teardown.

    Tearing down torch, transformers and peft takes seconds per rank (2.5-3.5 s measured
    on the 2-core dev machine), and a stopping group has nothing left to tear down (its
    results are written, its process group destroyed). The exit handlers still run, then
    the logs are flushed.
    """
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun --nproc-per-node N -m fedexlora.run.worker_main JOBDIR")
    _leave(main(sys.argv[1]))
