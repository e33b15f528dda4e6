"""Tests for the commit journal: index sets, checksummed records, torn tails, corruption."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from vbatch.errors import JobStateError
from vbatch.job.journal import JOURNAL_NAME, IndexSet, Journal, read_journal, to_ranges


def test_index_set_ranges_round_trip() -> None:
    rng = random.Random(0)
    members = set(rng.sample(range(5000), 1200))
    index_set = IndexSet()
    index_set.add_ranges(to_ranges(members))
    assert len(index_set) == len(members)
    assert all(i in index_set for i in members)
    assert not any(i in index_set for i in set(range(6000)) - members)
    rebuilt = {i for start, stop in index_set.ranges() for i in range(start, stop)}
    assert rebuilt == members


def test_index_set_counts_overlaps_and_discards() -> None:
    index_set = IndexSet(capacity=4)
    index_set.add_range(0, 10)
    index_set.add_range(5, 3000)
    assert len(index_set) == 3000
    index_set.discard_ranges([[100, 200], [2990, 5000]])
    assert len(index_set) == 3000 - 100 - 10
    assert index_set.ranges() == [[0, 100], [200, 2990]]
    assert 99 in index_set and 100 not in index_set and 10**9 not in index_set


def test_to_ranges_is_sorted_and_half_open() -> None:
    assert to_ranges([5, 3, 4, 9, 0]) == [[0, 1], [3, 6], [9, 10]]
    assert to_ranges([]) == []


def test_journal_replays_commits_retries_and_completion(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append("commit", rows=3, indices=[[0, 3]], errors=[[1, 2]], offset=120)
    journal.append("commit", rows=2, indices=[[5, 7]], errors=[], part="parts/part-000001.parquet")
    journal.append("retry", indices=[[1, 2]], offset=120)
    journal.close()
    state, valid_length = read_journal(tmp_path / JOURNAL_NAME)
    assert valid_length == (tmp_path / JOURNAL_NAME).stat().st_size
    assert state.committed.ranges() == [[0, 1], [2, 3], [5, 7]]
    assert len(state.errors) == 0
    assert state.offset == 120
    assert state.parts == [(1, "parts/part-000001.parquet")]
    assert [r.seq for r in state.retries] == [2] and 1 in state.retries[0].indices
    assert state.next_seq == 3 and state.complete is None


@pytest.mark.parametrize("cut", [1, 5, 20])
def test_torn_last_record_is_discarded_and_cut(tmp_path: Path, cut: int) -> None:
    journal = Journal(tmp_path)
    journal.append("commit", rows=1, indices=[[0, 1]], errors=[], offset=10)
    journal.append("commit", rows=1, indices=[[1, 2]], errors=[], offset=20)
    journal.close()
    path = tmp_path / JOURNAL_NAME
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    reopened = Journal(tmp_path)
    assert reopened.state.committed.ranges() == [[0, 1]]
    assert reopened.state.offset == 10
    reopened.append("commit", rows=1, indices=[[1, 2]], errors=[], offset=20)
    reopened.close()
    state, _ = read_journal(path)
    assert state.committed.ranges() == [[0, 2]] and state.num_records == 2


def test_bad_checksum_in_last_record_is_treated_as_torn(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append("commit", rows=1, indices=[[0, 1]], errors=[], offset=10)
    journal.append("commit", rows=1, indices=[[1, 2]], errors=[], offset=20)
    journal.close()
    path = tmp_path / JOURNAL_NAME
    path.write_bytes(path.read_bytes().replace(b'"offset":20', b'"offset":99'))
    state, _ = read_journal(path)
    assert state.offset == 10 and len(state.committed) == 1


def test_corruption_before_the_end_is_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.append("commit", rows=1, indices=[[0, 1]], errors=[], offset=10)
    journal.append("commit", rows=1, indices=[[1, 2]], errors=[], offset=20)
    journal.close()
    path = tmp_path / JOURNAL_NAME
    path.write_bytes(path.read_bytes().replace(b'"offset":10', b'"offset":11'))
    with pytest.raises(JobStateError, match="corrupt at record 1"):
        read_journal(path)


@pytest.mark.parametrize("edit", ["drop", "repeat"])
def test_a_record_removed_or_repeated_is_refused_under_python_o_too(
    tmp_path: Path, edit: str
) -> None:
    """Each record is intact, but the sequence is not: resuming from it could run or write rows
    twice, so it is corruption (a real check, not an assert that `python -O` drops)."""
    journal = Journal(tmp_path)
    for i in range(3):
        journal.append("commit", rows=1, indices=[[i, i + 1]], errors=[], offset=10 * (i + 1))
    journal.close()
    path = tmp_path / JOURNAL_NAME
    lines = path.read_bytes().splitlines(keepends=True)
    edited = [lines[0], lines[2]] if edit == "drop" else [lines[0], lines[1], lines[1], lines[2]]
    path.write_bytes(b"".join(edited))
    with pytest.raises(JobStateError, match=r"corrupt at record \d: its records are out of seq"):
        read_journal(path)
    code = (
        "import sys; from pathlib import Path; from vbatch.errors import JobStateError; "
        "from vbatch.job.journal import read_journal\n"
        "try:\n    read_journal(Path(sys.argv[1]))\nexcept JobStateError:\n    sys.exit(3)"
    )
    assert subprocess.run([sys.executable, "-O", "-c", code, str(path)]).returncode == 3


def test_missing_journal_is_an_empty_state(tmp_path: Path) -> None:
    state, valid_length = read_journal(tmp_path / JOURNAL_NAME)
    assert valid_length == 0 and len(state.committed) == 0 and state.next_seq == 0
