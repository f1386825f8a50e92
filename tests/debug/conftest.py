"""Fixture that captures one training step of the test model."""

import pytest

import oarlock.debug as od
from debug_model import make_inputs, train_step


@pytest.fixture
def run(tmp_path):
    """run(name, perturb=False, extra_in=None, **capture_kwargs) -> dump path of one captured step."""

    def _run(name, perturb=False, extra_in=None, **kw):
        model, x, y = make_inputs(perturb)
        path = tmp_path / f"{name}.jsonl"
        with od.capture(path, **kw):
            train_step(model, x, y, extra_in)
        return path

    return _run
