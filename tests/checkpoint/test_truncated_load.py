"""Issue 48 item 6: a load writes no target before every file it will read is known to be whole. A checkpoint saved
by 2 ranks (two data files) whose second file is truncated by 10 bytes: a load in one process, and on 2 ranks, in
every layout and checksum mode, raises naming the file with the size its header says and the size it has, and
every target element keeps its sentinel (scenarios in ``_truncated_scenarios.py``)."""

from __future__ import annotations

import pytest
import torch

from oarlock.checkpoint import CheckpointError, ShardedWeight, load_state_dict

from _truncated_scenarios import (N, SENTINEL, check_refused, source, target_tensors, targets,  # isort: skip
                                  truncate_second_file)


def test_one_process_load_of_a_truncated_second_file_writes_nothing(multirank):
    outcome = multirank("_truncated_scenarios", world=2, names=["scenario_save_two_files"])
    outcome.check()
    ck = multirank.root / "two"
    whole = {k: torch.full_like(v, SENTINEL) for k, v in source().items()}
    load_state_dict(whole, ck)  # whole, it loads: the two files hold what was saved
    assert all(torch.equal(whole[k], v) for k, v in source().items())
    size = truncate_second_file(ck)
    for verify in (True, False, "overlap"):
        # one process reading both files: whole targets, or both column blocks of w
        for state in (targets("whole", 0, 1), targets("columns", 0, 2), targets("columns", 1, 2)):
            with pytest.raises(CheckpointError) as info:
                load_state_dict(state, ck, verify_checksums=verify)
            check_refused(info.value, ck, size)
            for k, t in target_tensors(state).items():
                assert bool((t == SENTINEL).all()), (verify, k, t)
        # the first file alone is whole: a load of only its rows succeeds
        rows = {"w": ShardedWeight("w", torch.full((N // 2, N), SENTINEL), (N // 2, N), (N, N), (0, 0))}
        load_state_dict(rows, ck, verify_checksums=verify, strict=False)
        assert torch.equal(rows["w"].local_tensor, source()["w"][:N // 2])


def test_two_rank_load_of_a_truncated_second_file_writes_nothing_on_any_rank(multirank):
    outcome = multirank("_truncated_scenarios", world=2,
                        names=["scenario_truncated_second_file_fails_every_rank_before_any_write"])
    outcome.check()
    # the rank that does not read the bad file itself is told which rank did
    msgs = outcome.values("truncated_second_file_fails_every_rank_before_any_write")
    assert all(m for m in msgs)
