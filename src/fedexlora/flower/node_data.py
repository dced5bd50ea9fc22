"""A SuperNode's own data file (``data="PATH"``) and adapters folder (``adapters-dir``).

The server never reads the file. The node trains on the file's rows in place of its
slice of the run's task; the task gives the classes they are labelled with and the
tokenizer (:mod:`fedexlora.tasks.own_data`).
Its problems stop the run: :func:`node_file` at the server's first query,
:func:`node_rows` at a round (the ClientApp replies with the error).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["NodeDataError", "adapters_dir", "node_file", "node_rows"]

_OWN: dict[tuple, object] = {}  # (fingerprint, file, mtime, size) -> its Encoded rows, one entry


def adapters_dir(node: Mapping[str, Any], run_id: int, method: str, conf: Mapping) -> str:
    """Where this node keeps the adapter it trained (``""``: nowhere).

    Its own ``adapters-dir`` (a folder per run and method, every round: the adapter is the
    node's), else the run directory the server names when the run asks for adapters
    (``save_client_adapters``, sent as ``adapters-dir``).
    """
    mine = str(node.get("adapters-dir", "") or "")
    if mine:
        return str(Path(mine).expanduser() / f"run-{run_id}" / method)
    return str(conf.get("adapters-dir", ""))


class NodeDataError(ValueError):
    """This node's own data file cannot serve the run: the run stops with its reason."""


def node_file(node: Mapping[str, Any], cfg, task=None) -> Path | None:
    """This node's own data file (``--node-config data=PATH``), or ``None``.

    With ``task`` (the run's task, or a callable that loads it, called only when the node
    has a file) its rows are checked against it, as a query does before round 1; a
    message's :func:`node_rows` checks them as it reads them.

    Raises:
        NodeDataError: If the file is missing or does not fit the task; under secure
            aggregation the reason stays in this node's log (a warning), and the server
            is told only that the file cannot serve the run.
    """
    from fedexlora.tasks.own_data import own_rows

    own = str(node.get("data", "") or "")
    if not own:
        return None
    path = Path(own).expanduser()
    try:
        if not path.is_file():
            raise ValueError(f"no such file on this node: {own!r}")
        if task is not None:
            own_rows(path, task() if callable(task) else task)
    except ValueError as exc:
        raise _node_problem(exc, cfg) from None
    return path


def _node_problem(exc: Exception, cfg) -> NodeDataError:
    """What the server is told of a problem with this node's data file."""
    if not cfg.secure_aggregation:
        return NodeDataError(f"node config data: {exc}")
    # its reasons name its rows (a label, a count) or its paths: under secure aggregation
    # they stay on this node, as its DP figures do
    warnings.warn(f"node config data: {exc}", stacklevel=3)
    return NodeDataError(
        "this node's data file (node config data) cannot serve the run's task; under "
        "secure aggregation its reasons stay in its own log"
    )


def node_rows(where: Path, cfg, prep, fingerprint: str):
    """This node's own training rows, from its file (:func:`node_file`; cached).

    They take the place of its partition's slice of the run's task; the run's task gives
    the classes they are labelled with and the tokenizer (:mod:`fedexlora.tasks.own_data`).

    Raises:
        NodeDataError: Naming the file and its problem (as :func:`_node_problem`).
    """
    from fedexlora.run.build import encode_rows
    from fedexlora.tasks.own_data import own_rows

    stat = where.stat()
    key = (fingerprint, str(where.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _OWN:
        _OWN.clear()
        try:
            _OWN[key] = encode_rows(cfg, prep, own_rows(where, prep.task))
        except ValueError as exc:
            raise _node_problem(exc, cfg) from None
    return _OWN[key]
