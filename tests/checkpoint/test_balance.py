"""Reader assignment on node-local disks: each needed file read once, by a rank that sees it, balanced."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oarlock.checkpoint import CheckpointError
from oarlock.checkpoint.planning.assign import assign_readers


def test_spec_example_two_ranks_share_file1():
    needs = {0: {"file1": 10, "file2": 10}, 1: {"file1": 10, "file3": 10}}
    visible = {0: {"file1", "file2"}, 1: {"file1", "file3"}}
    readers = assign_readers(needs, visible)
    assert readers == {"file2": 0, "file3": 1, "file1": 0}
    assert sorted(f for f, r in readers.items() if r == 0) == ["file1", "file2"]


def test_rank_that_cannot_see_its_file_reads_nothing():
    needs = {0: {"a": 5}, 1: {"b": 5}}
    visible = {0: {"a", "b"}, 1: set()}
    readers = assign_readers(needs, visible)
    assert readers == {"a": 0, "b": 0}


def test_balances_bytes_not_counts():
    # two nodes: ranks 0,1 see f0..f3, ranks 2,3 see f4..f7; everybody needs everything of its node
    files = {f"f{i}": (100 if i in (0, 4) else 10) for i in range(8)}
    visible = {r: {f"f{i}" for i in range(8) if (i < 4) == (r < 2)} for r in range(4)}
    needs = {r: {f: files[f] for f in visible[r]} for r in range(4)}
    readers = assign_readers(needs, visible, files)
    per: dict[int, int] = {}
    for f, r in readers.items():
        per[r] = per.get(r, 0) + files[f]
    assert per == {0: 100, 1: 30, 2: 100, 3: 30}  # the big file alone on one rank, three small on the other


def test_invisible_file_is_an_error_naming_it():
    with pytest.raises(CheckpointError, match="not complete: lost.safetensors visible to no rank"):
        assign_readers({0: {"lost.safetensors": 1}}, {0: set(), 1: {"other"}})


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda w: st.tuples(
    st.just(w),
    st.lists(st.tuples(st.integers(1, 1000), st.sets(st.integers(0, w - 1), min_size=1),
                       st.sets(st.integers(0, w - 1))), min_size=1, max_size=12))))
def test_every_file_read_once_by_a_rank_that_sees_it(case):
    w, files = case
    visible = {r: set() for r in range(w)}
    needs = {r: {} for r in range(w)}
    sizes = {}
    for i, (size, seers, needers) in enumerate(files):
        f = f"f{i}"
        sizes[f] = size
        for r in seers:
            visible[r].add(f)
        for r in needers:
            needs[r][f] = size
    needed = {f for r in needs for f in needs[r]}
    readers = assign_readers(needs, visible, sizes)
    assert set(readers) == needed
    for f, r in readers.items():
        assert f in visible[r]
        # a needing rank that sees the file is preferred over a rank that does not need it
        if any(f in visible[n] for n in range(w) if f in needs[n]):
            assert f in needs[r]
    assert readers == assign_readers(needs, visible, sizes)  # deterministic
