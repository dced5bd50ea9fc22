"""docs/METHODS.md covers every method of the registry: a new one cannot go unnoticed."""

import re
from pathlib import Path

from fedexlora.core.methods import method_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "METHODS.md"


def test_every_registered_method_is_described_and_in_the_study():
    text = DOC.read_text()
    names = set(method_names())
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/METHODS.md does not describe {missing}"
    study = re.search(r"fedexlora compare \\\n\s+--method ([a-z0-9_,]+)", text)
    assert study, "the study's command is gone"
    assert set(study.group(1).split(",")) == names  # the study ran every method, no other
    for count in re.findall(r"\ball (\d+) methods\b", text):  # a count, where one is given
        assert int(count) == len(names), f"'all {count} methods' but {len(names)} registered"
