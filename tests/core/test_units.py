"""One unit for bytes: SI, as every report and doc prints them."""

import pytest

from fedexlora.core.units import format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1 kB"),
        (892_436, "892 kB"),
        (999_499, "999 kB"),
        (999_500, "1 MB"),  # not "1000 kB"
        (999_999_999, "1 GB"),
        (7_380_500, "7.38 MB"),
        (22_141_500, "22.1 MB"),
        (171_638_784, "172 MB"),
        (2**20, "1.05 MB"),  # a MiB is not a MB
        (-5_000_000, "-5 MB"),
    ],
)
def test_format_bytes_is_si_with_three_digits(n, text):
    assert format_bytes(n) == text


def test_compare_reuses_a_cell_saved_before_weighting_was_unset():
    """A cell saved with weighting "examples" is the same run as today's unset weighting
    for every method whose own weighting is by examples; not for fedsa (uniform)."""
    from fedexlora.config import RunConfig
    from fedexlora.experiments.compare import cell_changes

    old = RunConfig(methods=["fedex", "fedit"]).resolved().to_dict() | {"weighting": "examples"}
    assert cell_changes(old, RunConfig(methods=["fedex", "fedit"])) == []
    old = RunConfig(methods=["fedex", "fedsa"]).resolved().to_dict() | {"weighting": "examples"}
    assert [c.split(":")[0] for c in cell_changes(old, RunConfig(methods=["fedex", "fedsa"]))] == [
        "weighting"
    ]
