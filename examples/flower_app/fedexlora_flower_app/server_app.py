"""Your ServerApp: fedex-lora's strategy over its Server, and a global model to measure."""

import json

from flwr.app import Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedexlora import Server, apply_outcome, get_state, layer_info
from fedexlora.flower.records import to_array_record
from fedexlora.flower.strategy import FedExLoRA, NodeDirectory

from .task import new_model, settings

app = ServerApp()
LAST_RUN: dict = {}  # the last run's global model, server and rounds, for in-process callers


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Runs the rounds; prints each round's exactness, measured on the global model."""
    cfg = settings(context.run_config)
    parts = int(cfg["num-partitions"])
    LAST_RUN.clear()
    model = new_model(cfg)  # the server's copy of the global model
    server = Server(get_state(model), layer_info(model), num_clients=parts)
    strategy = FedExLoRA(server, NodeDirectory(parts))

    def after_round(rnd, _arrays):
        if rnd == 0:
            return None
        rec = strategy.current
        deviation = apply_outcome(model, server, rec.outcome, rec.uploads)
        worst = max(deviation.values(), default=0.0)
        LAST_RUN.setdefault("rounds", []).append((rec.outcome, rec.uploads))
        print(json.dumps({"round": rnd, "accepted": rec.outcome.accepted, "max-deviation": worst}))
        return MetricRecord({"max-deviation": worst})

    strategy.start(
        grid,
        initial_arrays=to_array_record(server.state.to_flat()),
        num_rounds=int(cfg["num-rounds"]),
        evaluate_fn=after_round,
    )
    LAST_RUN.update(model=model, server=server)
