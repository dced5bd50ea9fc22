"""The ServerApp: fedex-lora's exact aggregation as the strategy, the global adapter saved
each round (``peft_<round>/``, as FlowerTune saves it), and the final one scored.
"""

import json
import time
from pathlib import Path

from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedexlora import Server, apply_outcome, get_state, layer_info
from fedexlora.bridge.models import resolve_model
from fedexlora.flower.records import to_array_record
from fedexlora.flower.strategy import FedExLoRA, NodeDirectory
from fedexlora.run.export import save_adapter
from fedexlora.tasks.metrics import exact_match
from fedexlora.training.sft import chat_generate

from .dataset import app_config, load_task_splits
from .models import get_model

app = ServerApp()
LAST_RUN: dict = {}  # the last run's global model, server, rounds and scores (in-process)
METHODS = ("fedex", "fedit")  # exact, or FlowerTune's FedAvg of the factors (to compare)


def evaluate(model, tokenizer, cfg) -> dict:
    """Greedy generations on the first ``eval.items`` held-out items, and exact match."""
    test = load_task_splits(cfg).test
    test = test.select(range(min(int(cfg.eval.items), len(test))))
    prompts, answers = list(test["prompt"]), list(test["answer"])
    gens = chat_generate(model, tokenizer, prompts, max_new_tokens=int(cfg.eval.max_new_tokens))
    return {
        "exact_match": exact_match(gens, answers),
        "prompts": prompts,
        "answers": answers,
        "generations": gens,
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Runs the rounds: each round's global model measured against the ideal, and saved."""
    cfg = app_config(context.run_config)
    method = str(cfg.strategy.method)
    if method not in METHODS:
        raise ValueError(f"strategy.method must be one of {METHODS}, got {method!r}")
    parts, rounds = int(cfg.strategy.num_partitions), int(cfg.num_server_rounds)
    every = max(1, int(cfg.train.save_every_round))
    save_path = Path(str(cfg.results_dir)) / time.strftime("%Y-%m-%d_%H-%M-%S")
    save_path.mkdir(parents=True, exist_ok=True)
    LAST_RUN.clear()
    LAST_RUN["save_path"] = save_path
    model, tokenizer = get_model(cfg.model)  # the server's copy of the global model
    base_name = resolve_model(str(cfg.model.name)).path  # what peft's loaders can open
    server = Server(get_state(model), layer_info(model), method=method, num_clients=parts)
    strategy = FedExLoRA(
        server, NodeDirectory(parts), fraction_train=float(cfg.strategy.fraction_train)
    )

    def after_round(rnd, _arrays):
        if rnd == 0:
            return None
        rec = strategy.current
        deviation = apply_outcome(model, server, rec.outcome, rec.uploads)  # on the model
        worst = max(deviation.values(), default=0.0)
        LAST_RUN.setdefault("rounds", []).append((rec.outcome, rec.uploads))
        if rnd % every == 0 or rnd == rounds:  # the global PEFT adapter, as FlowerTune
            save_adapter(model, save_path / f"peft_{rnd}", base=base_name)
        line = {"round": rnd, "accepted": rec.outcome.accepted, "max-deviation": worst}
        print(json.dumps(line), flush=True)
        return MetricRecord({"max-deviation": worst})

    strategy.start(
        grid,
        initial_arrays=to_array_record(server.state.to_flat()),
        num_rounds=rounds,
        evaluate_fn=after_round,
    )
    scores = evaluate(model, tokenizer, cfg)
    (save_path / "eval.json").write_text(json.dumps({"round": rounds, **scores}, indent=1))
    print(
        json.dumps({"exact-match": scores["exact_match"], "items": len(scores["answers"]),
                    "adapter": str(save_path / f"peft_{rounds}")}),
        flush=True,
    )  # fmt: skip
    LAST_RUN.update(model=model, tokenizer=tokenizer, server=server, scores=scores)
