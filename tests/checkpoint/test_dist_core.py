"""The distributed core (oarlock.checkpoint.runtime.dist): errors keep their class on every rank, no rank is left out of
step, and optimizer resume opens node-local checkpoints like model loads do.

The multi-rank scenarios live in _dist_core_scenarios.py and run on 4 gloo ranks in one launch; a failure names
the scenario and the rank with its traceback.
"""

import pytest
import torch

from oarlock.checkpoint import CheckpointError, CheckpointMismatchError, load_state_dict, save_state_dict
from oarlock.checkpoint.aoa import AOAError, AOASyntaxError
from oarlock.checkpoint.runtime.dist import DistWrapper, ErrorReport, rebuild_error
from oarlock.checkpoint.lifecycle.optim import OptimizerStateError


@pytest.mark.multiproc
def test_scenarios_on_four_gloo_ranks(multirank):
    multirank("_dist_core_scenarios", world=4).check()


def test_without_process_group_every_step_is_local():
    dw = DistWrapper()
    assert (dw.rank, dw.size, dw.active) == (0, 1, False)
    assert dw.all_gather_object({"a": 1}) == [{"a": 1}]
    assert dw.broadcast_object(5) == 5 and dw.all_true(True) and not dw.all_true(False)
    assert dw.run(lambda x: x + 1, 2) == 3
    assert dw.gather(lambda: "x") == ["x"]
    err = AOASyntaxError("bad statement")
    with pytest.raises(AOASyntaxError) as info:
        dw.check(err)
    assert info.value is err  # the failing rank raises its own exception object


def test_foreign_errors_become_checkpoint_errors_naming_the_type():
    with pytest.raises(CheckpointError, match=r"^OSError: disk gone$"):
        DistWrapper().run(lambda: (_ for _ in ()).throw(OSError("disk gone")))


@pytest.mark.parametrize("cls", [AOAError, AOASyntaxError, CheckpointMismatchError, OptimizerStateError])
def test_other_ranks_rebuild_the_same_class(cls):
    rep = ErrorReport(3, cls.__module__, cls.__qualname__, "what went wrong", True)
    e = rebuild_error(rep, 0)
    assert type(e) is cls and str(e) == "rank 3: what went wrong"


def test_error_classes_are_only_rebuilt_from_oarlock_or_builtins():
    rep = ErrorReport(1, "os", "system", "rm -rf", True)  # a hostile report cannot name an arbitrary callable
    e = rebuild_error(rep, 0)
    assert type(e) is CheckpointError and "rm -rf" in str(e)


def test_malformed_aoa_config_raises_aoa_error_in_one_process(tmp_path):
    save_state_dict({"w": torch.ones(4, 2)}, tmp_path / "ck")
    with pytest.raises(AOASyntaxError, match="w => v"):
        load_state_dict({"w": torch.zeros(4, 2)}, tmp_path / "ck", aoa_config={"aoa_statements": ["w => v"]})
