"""Each method validates the run's options it cannot run with (``MethodSpec.check``).

The configuration asks every method of the run; the messages are the method's own, and
no code outside the method's file knows them.
"""

import dataclasses

import pytest

from fedexlora.config import RunConfig
from fedexlora.core.methods import REGISTRY

CASES = [
    ("hetlora", dict(trainer="trl"), "`trainer` 'trl' cannot train method 'hetlora'"),
    ("hetlora", dict(dp_epsilon=8.0), "DP-SGD cannot be combined with method 'hetlora'"),
    ("rolora", dict(dp_epsilon=8.0), "method 'rolora' (its trained factor changes by round"),
    ("centralized", dict(dp_epsilon=8.0), "method 'centralized' (it has no clients"),
    ("frlora", dict(quantization="nf4"), "method 'frlora' starts its adapter from the SVD"),
    ("fedsb", dict(dp_epsilon=8.0, fedsb_init="gradient"), "`fedsb_init` gradient reads"),
    ("fedsb", dict(engine="flower"), "`fedsb_init` gradient needs the sum"),
]


@pytest.mark.parametrize("method,changes,message", CASES)
def test_a_method_refuses_what_it_cannot_run_with(method, changes, message, monkeypatch):
    cfg = RunConfig(methods=["fedex", method], **changes)
    assert any(message in e for e in cfg.errors()), cfg.errors()
    # the message is the method's own: without its check, nothing else says it
    monkeypatch.setitem(REGISTRY, method, dataclasses.replace(REGISTRY[method], check=None))
    assert not any(message in e for e in cfg.errors())


@pytest.mark.parametrize("method", [m for m, s in REGISTRY.items() if s.check is not None])
def test_a_method_accepts_the_defaults(method):
    assert REGISTRY[method].check(RunConfig(methods=[method])) == []
