"""Your ClientApp: your training loop between fedex-lora's two client calls.

What fedex-lora's strategy sends (a TRAIN message) and expects back:

- in: ``arrays`` (an ArrayRecord of the payload's tensors) and ``config`` with
  ``server-round``, ``partition-id``, ``version`` and ``base-version`` (the base version
  the payload builds on; -1 means "from the pretrained weights");
- out: ``arrays`` (the upload's tensors), ``metrics`` with ``num-examples`` (and
  optionally ``train-loss``), and ``config`` with ``partition-id``.

Before round 1 it asks each node once (a QUERY message) for its ``partition-id`` and
``num-partitions``.
"""

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedexlora import Payload, apply_payload, make_upload
from fedexlora.bridge.steps import client_state, load_client_state
from fedexlora.flower.records import from_array_record, to_array_record

from .task import load_shard, new_model, settings, train

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tells the server which partition this node holds."""
    node = context.node_config
    reply = {"partition-id": int(node["partition-id"]), "fingerprint": "", "error": ""}
    reply["num-partitions"] = int(node["num-partitions"])
    return Message(RecordDict({"config": ConfigRecord(reply)}), reply_to=msg)


@app.train()
def train_round(msg: Message, context: Context) -> Message:
    """Apply the payload, train with your loop, upload."""
    cfg = settings(context.run_config)
    conf = msg.content["config"]
    pid, parts = (
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
    )
    rnd, since = int(conf["server-round"]), int(conf["base-version"])
    model = new_model(cfg)  # the pretrained weights ...
    if since >= 0:  # ... plus what earlier payloads changed, kept in this node's Context
        if context.state.get("fedexlora") is None or context.state["held"]["version"] != since:
            raise RuntimeError("this node lost its model; the server will re-send it in full")
        load_client_state(model, from_array_record(context.state["fedexlora"]))
    payload = Payload.from_flat(
        from_array_record(msg.content["arrays"]), round=rnd, version=int(conf["version"])
    )
    apply_payload(model, payload)
    data = load_shard(cfg, pid, parts)
    loss = train(model, data, int(cfg["local-steps"]), float(cfg["lr"]), seed=1000 * rnd + pid)
    context.state["fedexlora"] = to_array_record(client_state(model))
    context.state["held"] = ConfigRecord({"version": int(conf["version"])})
    upload = make_upload(model, len(data[2]), client_id=pid, train_loss=loss)
    content = {
        "arrays": to_array_record(upload.to_flat()),
        "metrics": MetricRecord({"num-examples": upload.num_examples, "train-loss": loss}),
        "config": ConfigRecord({"partition-id": pid}),
    }
    return Message(RecordDict(content), reply_to=msg)
