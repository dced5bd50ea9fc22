"""Split a dataset across federated clients with flwr-datasets partitioners.

:func:`partition` returns row indices rather than datasets so callers can keep one copy
of the data and select per-client views (``dataset.select(indices)``) cheaply.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import datasets
import numpy as np
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

__all__ = ["SCHEMES", "describe_partitions", "partition", "partition_like"]

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "group")

_INDEX = "__index__"


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_discrete(feature: object) -> bool:
    if isinstance(feature, datasets.ClassLabel):
        return True
    if isinstance(feature, datasets.Value):
        dtype = feature.dtype
        return dtype.startswith(("int", "uint")) or dtype in ("bool", "string", "large_string")
    return False


def partition(
    dataset: datasets.Dataset,
    num_clients: int,
    *,
    scheme: str = "dirichlet",
    alpha: float = 0.5,
    seed: int = 0,
    min_partition_size: int = 2,
    label_column: str = "label",
    group_column: str = "group",
) -> list[list[int]]:
    """Partition the rows of ``dataset`` across ``num_clients`` clients.

    ``"iid"`` shuffles the rows with ``seed`` and cuts them into ``num_clients`` contiguous
    shards of near-equal size (flwr-datasets ``IidPartitioner``). ``"dirichlet"`` draws,
    for every class, the clients' shares from a symmetric Dirichlet(``alpha``) distribution
    (flwr-datasets ``DirichletPartitioner``, no self-balancing); small ``alpha`` gives
    strongly label-skewed clients, large ``alpha`` approaches IID. Sampling is retried
    (up to 11 draws) until every client has at least ``min_partition_size`` rows.
    ``"group"`` gives each client whole groups (``deepmind-math``'s modules: non-IID by
    topic): the distinct values of ``group_column``, sorted, are dealt round-robin, the
    i-th to client ``i % num_clients``; it needs at least as many groups as clients.

    Args:
        dataset: The dataset to split.
        num_clients: Number of clients, between 1 and ``len(dataset)``.
        scheme: ``"iid"``, ``"dirichlet"`` or ``"group"``.
        alpha: Dirichlet concentration, > 0 (validated for both schemes).
        seed: Seed for the shuffle (iid) or the Dirichlet draws (dirichlet).
        min_partition_size: Minimum rows per client, >= 1.
        label_column: Column with discrete labels (dirichlet only).
        group_column: Column whose values are dealt to the clients (group only).

    Returns:
        For each client, the sorted row indices into ``dataset``. Together they cover every
        row exactly once.

    Raises:
        ValueError: On invalid arguments, a dataset without a discrete ``label_column`` for
            ``"dirichlet"`` (or ``group_column`` for ``"group"``), too few rows, fewer
            groups than clients, or when the partition cannot satisfy ``min_partition_size``.
    """
    if not isinstance(dataset, datasets.Dataset):
        raise ValueError(
            f"dataset must be a datasets.Dataset, got dataset of type {type(dataset).__name__}"
        )
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(map(repr, SCHEMES))}")
    n = len(dataset)
    if not _is_int(num_clients) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got num_clients={num_clients!r}")
    if num_clients > n:
        raise ValueError(
            f"num_clients={num_clients} is larger than the dataset, which has {n} rows; "
            "use fewer clients"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise ValueError(f"alpha must be a positive number, got alpha={alpha!r}")
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"alpha must be a positive finite number, got alpha={alpha!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got seed={seed!r}")
    if not _is_int(min_partition_size) or min_partition_size < 1:
        raise ValueError(
            f"min_partition_size must be an integer >= 1, got "
            f"min_partition_size={min_partition_size!r}"
        )
    if n < num_clients * min_partition_size:
        raise ValueError(
            f"too few examples: the dataset has {n} rows, but num_clients={num_clients} "
            f"clients with at least min_partition_size={min_partition_size} rows each need "
            f"{num_clients * min_partition_size}; use fewer clients, a smaller "
            "min_partition_size, or a bigger task (the generated 'synthetic:N' has N)"
        )

    if scheme == "group":
        return _by_group(dataset, int(num_clients), group_column, int(min_partition_size))
    if scheme == "iid":
        order = np.random.default_rng(int(seed)).permutation(n)
        proxy = datasets.Dataset.from_dict({_INDEX: order})
        partitioner = IidPartitioner(num_partitions=int(num_clients))
    else:
        if label_column not in dataset.column_names:
            raise ValueError(
                f"scheme 'dirichlet' needs a label column, but label_column={label_column!r} "
                f"is not among the dataset columns {dataset.column_names}; use scheme 'iid' "
                "(e.g. for causal LM data) or pass the right label_column"
            )
        if not _is_discrete(dataset.features[label_column]):
            raise ValueError(
                f"scheme 'dirichlet' needs discrete labels, but column {label_column!r} has "
                f"feature {dataset.features[label_column]}; use scheme 'iid' for regression"
            )
        proxy = datasets.Dataset.from_dict(
            {_INDEX: np.arange(n), label_column: list(dataset[label_column])}
        )
        partitioner = DirichletPartitioner(
            num_partitions=int(num_clients),
            partition_by=label_column,
            alpha=float(alpha),
            min_partition_size=int(min_partition_size),
            self_balancing=False,
            shuffle=True,
            seed=int(seed),
        )

    partitioner.dataset = proxy
    try:
        with warnings.catch_warnings():
            # flwr-datasets warns on every failed Dirichlet draw; failure is reported below.
            warnings.simplefilter("ignore", UserWarning)
            parts = [
                sorted(int(i) for i in partitioner.load_partition(cid)[_INDEX])
                for cid in range(int(num_clients))
            ]
    except ValueError as err:
        if scheme != "dirichlet":
            raise
        raise ValueError(
            f"dirichlet partitioning could not give each of num_clients={num_clients} clients "
            f"at least min_partition_size={min_partition_size} rows with alpha={alpha} after "
            f"11 draws ({n} rows); increase alpha, use fewer clients, or lower "
            f"min_partition_size (flwr-datasets: {err})"
        ) from err
    return parts


def _by_group(
    dataset: datasets.Dataset, num_clients: int, column: str, min_size: int
) -> list[list[int]]:
    """Whole groups per client: the sorted groups dealt round-robin (see :func:`partition`)."""
    if column not in dataset.column_names:
        raise ValueError(
            f"partition 'group' needs a {column!r} column (deepmind-math's module), but the "
            f"dataset has only {dataset.column_names}; use partition 'iid' or 'dirichlet'"
        )
    values = [str(v) for v in dataset[column]]
    groups = sorted(set(values))
    if len(groups) < num_clients:
        raise ValueError(
            f"partition 'group' deals whole groups to clients, but the task has "
            f"{len(groups)} groups ({', '.join(groups)}) for {num_clients} clients; "
            "use fewer clients or more modules"
        )
    owner = {g: i % num_clients for i, g in enumerate(groups)}
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for row, value in enumerate(values):
        parts[owner[value]].append(row)
    small = [(c, len(p)) for c, p in enumerate(parts) if len(p) < min_size]
    if small:
        cid, size = small[0]
        raise ValueError(
            f"partition 'group': client {cid} gets {size} rows, fewer than "
            f"min_partition_size={min_size}; use fewer clients, more examples per module "
            "or a smaller min_partition_size"
        )
    return parts


def describe_partitions(
    dataset: datasets.Dataset,
    parts: Sequence[Sequence[int]],
    label_names: Sequence[str] | None = None,
    *,
    label_column: str = "label",
) -> str:
    """Render a plain-text table of client sizes and label histograms.

    One line per client with its number of rows and, when ``dataset`` has a discrete
    ``label_column``, the count of each label, followed by a total line.

    Args:
        dataset: The partitioned dataset.
        parts: Row indices per client, as returned by :func:`partition`.
        label_names: Names for label ids; defaults to the ``ClassLabel`` names of the
            column, or the raw label values.
        label_column: The label column to histogram.

    Returns:
        The table as a string (no trailing newline).

    Raises:
        ValueError: If an index is out of range or ``label_names`` is too short.
    """
    n = len(dataset)
    for cid, idx in enumerate(parts):
        bad = [i for i in idx if not 0 <= int(i) < n]
        if bad:
            raise ValueError(
                f"parts[{cid}] has indices out of range for a dataset of {n} rows: {bad[:5]}"
            )

    has_labels = label_column in dataset.column_names and _is_discrete(
        dataset.features[label_column]
    )
    if not has_labels:
        width = max(len("client"), len(str(len(parts))))
        size_w = max(len("size"), len(str(n)))
        lines = [f"{'client':>{width}}  {'size':>{size_w}}"]
        lines += [f"{cid:>{width}}  {len(idx):>{size_w}}" for cid, idx in enumerate(parts)]
        total = sum(len(idx) for idx in parts)
        lines.append(f"{'total':>{width}}  {total:>{size_w}}")
        return "\n".join(lines)

    labels = list(dataset[label_column])
    values = sorted(set(labels), key=lambda v: (str(type(v)), v))
    int_labels = all(_is_int(v) for v in values)
    if label_names is None:
        feature = dataset.features[label_column]
        label_names = feature.names if isinstance(feature, datasets.ClassLabel) else None
    if label_names is not None and int_labels:
        if values and not (0 <= min(values) and max(values) < len(label_names)):
            raise ValueError(
                f"label_names has {len(label_names)} names, but the labels range from "
                f"{min(values)} to {max(values)}"
            )
        values = list(range(len(label_names)))
        headers = [str(name) for name in label_names]
    else:
        headers = [str(v) for v in values]

    counts = [Counter(labels[int(i)] for i in idx) for idx in parts]
    total_counts = Counter(labels[int(i)] for idx in parts for i in idx)
    rows = [
        [str(cid), str(len(idx)), *(str(c[v]) for v in values)]
        for cid, c, idx in zip(range(len(parts)), counts, parts, strict=True)
    ]
    rows.append(
        ["total", str(sum(len(idx) for idx in parts)), *(str(total_counts[v]) for v in values)]
    )
    header = ["client", "size", *headers]
    widths = [max(len(r[j]) for r in [header, *rows]) for j in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )


def partition_like(
    train_labels: Sequence | None,
    parts: Sequence[Sequence[int]],
    test_labels: Sequence | None,
    num_test: int,
    *,
    seed: int = 0,
) -> list[list[int]]:
    """Splits a test set across the clients of ``parts`` the way their training data is split.

    Each client gets, of every class, the share of the test examples that it holds of
    that class's training examples, so its test split is drawn like its training data
    (a Dirichlet-skewed client is tested on its own skew; IID clients on near-IID
    splits). Without labels the test set is shuffled with ``seed`` and cut evenly.
    Used where each client is evaluated on its own data (personalized methods).

    Args:
        train_labels: The training examples' labels (``None``: no classes).
        parts: Each client's training row indices.
        test_labels: The test examples' labels (``None``: no classes).
        num_test: The number of test examples.
        seed: Seed for the order within each class.

    Returns:
        For each client, its sorted test row indices; together they cover every row once.
    """
    k = len(parts)
    rng = np.random.default_rng(int(seed))
    if train_labels is None or test_labels is None:
        return [sorted(int(i) for i in c) for c in np.array_split(rng.permutation(num_test), k)]
    train = np.asarray(train_labels)
    test = np.asarray(test_labels)
    out: list[list[int]] = [[] for _ in range(k)]
    for y in np.unique(test):
        rows = rng.permutation(np.flatnonzero(test == y))
        held = np.array([np.count_nonzero(train[list(p)] == y) for p in parts], dtype=float)
        share = held / held.sum() if held.sum() > 0 else np.full(k, 1.0 / k)
        cuts = np.round(np.cumsum(share)[:-1] * len(rows)).astype(int)
        for c, chunk in enumerate(np.split(rows, cuts)):
            out[c].extend(int(i) for i in chunk)
    return [sorted(c) for c in out]
