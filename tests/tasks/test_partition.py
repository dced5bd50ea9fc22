from __future__ import annotations

import datasets
import numpy as np
import pytest

from fedexlora.tasks.partition import describe_partitions, partition

NAMES = ["a", "b", "c", "d"]


@pytest.fixture(scope="module")
def labelled() -> datasets.Dataset:
    # 400 rows, 4 balanced classes, in a shuffled order.
    rng = np.random.default_rng(123)
    labels = rng.permutation(np.repeat(np.arange(4), 100)).tolist()
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=NAMES)}
    )
    return datasets.Dataset.from_dict(
        {"text": [f"row {i}" for i in range(400)], "label": labels}, features=features
    )


@pytest.fixture(scope="module")
def causal() -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"prompt": [f"p{i}" for i in range(30)], "response": [f"r{i}" for i in range(30)]}
    )


def _check_cover(parts: list[list[int]], n: int) -> None:
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # disjoint and complete
    for p in parts:
        assert p == sorted(p)
        assert all(isinstance(i, int) for i in p)


def _histograms(ds: datasets.Dataset, parts: list[list[int]]) -> np.ndarray:
    labels = np.array(ds["label"])
    return np.stack([np.bincount(labels[p], minlength=4) for p in parts])


def _skew(hist: np.ndarray) -> float:
    """Mean total-variation distance between client label mixes and the global mix."""
    global_mix = hist.sum(axis=0) / hist.sum()
    mixes = hist / hist.sum(axis=1, keepdims=True)
    return float(np.mean(0.5 * np.abs(mixes - global_mix).sum(axis=1)))


def test_iid_sizes_disjoint_deterministic(labelled: datasets.Dataset) -> None:
    parts = partition(labelled, 7, scheme="iid", seed=0)
    assert len(parts) == 7
    _check_cover(parts, 400)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 400 and max(sizes) - min(sizes) <= 1
    assert partition(labelled, 7, scheme="iid", seed=0) == parts
    assert partition(labelled, 7, scheme="iid", seed=1) != parts
    # Rows are shuffled before sharding, not cut into contiguous blocks.
    assert parts[0] != list(range(len(parts[0])))


def test_iid_without_labels(causal: datasets.Dataset) -> None:
    parts = partition(causal, 4, scheme="iid", seed=5)
    _check_cover(parts, 30)
    assert sorted(len(p) for p in parts) == [7, 7, 8, 8]


def test_dirichlet_cover_min_size_deterministic(labelled: datasets.Dataset) -> None:
    parts = partition(labelled, 5, scheme="dirichlet", alpha=0.5, seed=0, min_partition_size=10)
    _check_cover(parts, 400)
    assert min(len(p) for p in parts) >= 10
    again = partition(labelled, 5, scheme="dirichlet", alpha=0.5, seed=0, min_partition_size=10)
    assert again == parts
    other = partition(labelled, 5, scheme="dirichlet", alpha=0.5, seed=1, min_partition_size=10)
    assert other != parts


def test_dirichlet_small_alpha_is_skewed(labelled: datasets.Dataset) -> None:
    iid = _histograms(labelled, partition(labelled, 4, scheme="iid", seed=0))
    skewed = _histograms(labelled, partition(labelled, 4, scheme="dirichlet", alpha=0.1, seed=0))
    near_iid = _histograms(
        labelled, partition(labelled, 4, scheme="dirichlet", alpha=1000.0, seed=0)
    )
    assert _skew(iid) < 0.15
    assert _skew(near_iid) < 0.15
    assert _skew(skewed) > 0.4
    # With alpha=0.1 most clients are dominated by one or two classes.
    assert (skewed == 0).sum() >= 4


def test_dirichlet_string_labels() -> None:
    ds = datasets.Dataset.from_dict(
        {"text": [str(i) for i in range(60)], "label": ["x", "y", "z"] * 20}
    )
    parts = partition(ds, 3, alpha=1.0, seed=0)
    _check_cover(parts, 60)


def test_dirichlet_custom_label_column() -> None:
    ds = datasets.Dataset.from_dict({"x": list(range(40)), "topic": [0, 1] * 20})
    parts = partition(ds, 2, alpha=5.0, label_column="topic")
    _check_cover(parts, 40)


def test_partition_of_selected_view(labelled: datasets.Dataset) -> None:
    view = labelled.select(range(100, 300))
    parts = partition(view, 4, alpha=0.5, seed=0)
    _check_cover(parts, 200)
    # Indices refer to the view's rows, not the underlying table.
    texts = {view[i]["text"] for p in parts for i in p}
    assert texts == {f"row {i}" for i in range(100, 300)}


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_clients": 0}, r"num_clients must be an integer >= 1, got num_clients=0"),
        ({"num_clients": 2.0}, r"num_clients=2.0"),
        ({"num_clients": 401}, r"num_clients=401 is larger than the dataset, which has 400 rows"),
        ({"alpha": 0.0}, r"alpha must be a positive finite number, got alpha=0.0"),
        ({"alpha": -1}, r"alpha=-1"),
        ({"scheme": "shards"}, r"unknown scheme 'shards'; choose from 'iid', 'dirichlet'"),
        ({"min_partition_size": 0}, r"min_partition_size must be an integer >= 1"),
        ({"seed": None}, r"seed must be an integer, got seed=None"),
        (
            {"num_clients": 50, "min_partition_size": 10},
            r"too few examples: the dataset has 400 rows, but num_clients=50 clients with at "
            r"least min_partition_size=10 rows each need 500",
        ),
    ],
)
def test_argument_errors(labelled: datasets.Dataset, kwargs: dict, pattern: str) -> None:
    kwargs = {"num_clients": 4, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        partition(labelled, **kwargs)


def test_dirichlet_without_label_column(causal: datasets.Dataset) -> None:
    with pytest.raises(
        ValueError,
        match=r"scheme 'dirichlet' needs a label column, .* use scheme 'iid'",
    ):
        partition(causal, 3)


def test_dirichlet_on_float_labels() -> None:
    ds = datasets.Dataset.from_dict({"text": ["a"] * 10, "label": [0.5] * 10})
    with pytest.raises(ValueError, match=r"needs discrete labels.*use scheme 'iid' for regression"):
        partition(ds, 2)


def test_dirichlet_unsatisfiable_min_size() -> None:
    ds = datasets.Dataset.from_dict({"label": [0, 1] * 20})
    with pytest.raises(
        ValueError,
        match=r"could not give each of num_clients=10 clients at least min_partition_size=4 "
        r"rows with alpha=0.01 .* increase alpha, use fewer clients",
    ):
        partition(ds, 10, alpha=0.01, min_partition_size=4, seed=0)


def test_not_a_dataset() -> None:
    with pytest.raises(ValueError, match=r"dataset must be a datasets.Dataset, got .* list"):
        partition([1, 2, 3], 2)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- describe


def test_describe_with_labels(labelled: datasets.Dataset) -> None:
    parts = partition(labelled, 3, scheme="iid", seed=0)
    table = describe_partitions(labelled, parts)
    lines = table.splitlines()
    assert len(lines) == 1 + 3 + 1
    assert lines[0].split() == ["client", "size", *NAMES]
    hist = _histograms(labelled, parts)
    for cid, line in enumerate(lines[1:4]):
        cells = [int(c) for c in line.split()]
        assert cells == [cid, len(parts[cid]), *hist[cid].tolist()]
    assert lines[-1].split() == ["total", "400", "100", "100", "100", "100"]
    renamed = describe_partitions(labelled, parts, label_names=["w", "x", "y", "z"])
    assert renamed.splitlines()[0].split() == ["client", "size", "w", "x", "y", "z"]


def test_describe_without_labels(causal: datasets.Dataset) -> None:
    parts = partition(causal, 3, scheme="iid")
    lines = describe_partitions(causal, parts).splitlines()
    assert lines[0].split() == ["client", "size"]
    assert [line.split()[1] for line in lines[1:]] == ["10", "10", "10", "30"]


def test_describe_errors(labelled: datasets.Dataset) -> None:
    with pytest.raises(ValueError, match=r"parts\[1\] has indices out of range .* 400 rows"):
        describe_partitions(labelled, [[0, 1], [399, 400]])
    with pytest.raises(ValueError, match=r"label_names has 2 names, but the labels range from 0"):
        describe_partitions(labelled, [[0, 1, 2, 3]], label_names=["a", "b"])
