"""The ClientApp: FlowerTune's TRL ``SFTTrainer`` round between fedex-lora's two client calls.

What fedex-lora's strategy sends (a TRAIN message) and expects back:

- in: ``arrays`` (the payload: the global adapter, and the residual to fold into the
  base) and ``config`` with ``server-round``, ``version`` and ``base-version`` (the base
  version the payload builds on; -1 means "from the pretrained weights");
- out: ``arrays`` (this client's adapter), ``metrics`` with ``num-examples`` and
  ``train-loss``, and ``config`` with ``partition-id``.

Before round 1 it asks each node once (a QUERY message) for its ``partition-id`` and
``num-partitions``.
"""

import os
import tempfile
import warnings

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedexlora import Payload, apply_payload, make_upload
from fedexlora.bridge.steps import client_state, load_client_state
from fedexlora.flower.records import from_array_record, to_array_record
from fedexlora.training.sft import sft_config, train_sft

from .dataset import app_config, load_data
from .models import cosine_annealing, get_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning)

app = ClientApp()
_MODEL: dict = {}  # this process's model, reused by the clients it serves (reset each time)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tells the server which partition this node holds."""
    node = context.node_config
    reply = {"partition-id": int(node["partition-id"]), "fingerprint": "", "error": ""}
    reply["num-partitions"] = int(node["num-partitions"])
    return Message(RecordDict({"config": ConfigRecord(reply)}), reply_to=msg)


def _model(cfg):
    """One model per process: loading a quantized base costs more than a round here."""
    key = repr(vars(cfg.model))
    if _MODEL.get("key") != key:
        _MODEL.clear()
        _MODEL.update(key=key, model=get_model(cfg.model))
    return _MODEL["model"]


def _training_arguments(cfg) -> dict:
    """FlowerTune's ``train.training-arguments``, the unset ("") ones left out."""
    return {k: v for k, v in vars(cfg.train.training_arguments).items() if v != ""}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Apply the payload, train with TRL's SFTTrainer, upload the adapter."""
    cfg = app_config(context.run_config)
    pid = int(context.node_config["partition-id"])
    parts = int(context.node_config["num-partitions"])
    conf = msg.content["config"]
    rnd, since = int(conf["server-round"]), int(conf["base-version"])
    model, tokenizer = _model(cfg)
    if since >= 0:  # this node's model: the pretrained base plus what it was sent before
        held = context.state.get("held")
        if held is None or int(held["version"]) != since:
            raise RuntimeError("this node lost its model; the server will re-send it in full")
        load_client_state(model, from_array_record(context.state["fedexlora"]))
    payload = Payload.from_flat(
        from_array_record(msg.content["arrays"]),
        round=rnd,
        version=int(conf["version"]),
        reset=since < 0,  # from the pretrained weights: whatever the model held is dropped
    )
    apply_payload(model, payload)  # before local training

    trainset = load_data(pid, parts, cfg)
    args = _training_arguments(cfg)
    steps = int(args.pop("max_steps", -1))
    lr = cosine_annealing(
        rnd, int(cfg.num_server_rounds), cfg.train.learning_rate_max, cfg.train.learning_rate_min
    )
    with tempfile.TemporaryDirectory(prefix="flowertune-") as out:
        args.pop("output_dir", None)
        args.pop("learning_rate", None)
        sft = sft_config(
            out, steps=None if steps < 0 else steps, seed=1000 * rnd + pid, lr=lr,
            batch_size=int(args.pop("per_device_train_batch_size", 2)),
            epochs=float(args.pop("num_train_epochs", 1)),
            max_length=int(cfg.train.seq_length),
            device=next(model.parameters()).device,
            gradient_checkpointing=bool(args.pop("gradient_checkpointing", False)),
            **args,
        )  # fmt: skip
        loss = train_sft(model, tokenizer, trainset, sft).loss  # TRL's SFTTrainer

    context.state["fedexlora"] = to_array_record(client_state(model))
    context.state["held"] = ConfigRecord({"version": int(conf["version"])})
    upload = make_upload(model, len(trainset), client_id=pid, train_loss=loss)  # after
    content = {
        "arrays": to_array_record(upload.to_flat()),
        "metrics": MetricRecord({"num-examples": upload.num_examples, "train-loss": loss}),
        "config": ConfigRecord({"partition-id": pid}),
    }
    return Message(RecordDict(content), reply_to=msg)
