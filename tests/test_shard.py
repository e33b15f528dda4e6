"""Job-array shards: the stable split of rows by id, `--shard I/N|auto[/N]`, the shard pre-pass."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import write_jsonl
from typer.testing import CliRunner

from vbatch.cli import app
from vbatch.errors import ConfigError
from vbatch.job.reader import InputReader, scan_input
from vbatch.job.rows import ColumnOptions, RowParser
from vbatch.job.shard import (
    MAX_SHARDS,
    Shard,
    parse_shard,
    row_key,
    shard_of,
    shard_of_output,
    shards_on_disk,
)
from vbatch.sampling_params import SamplingParams

PARSER = RowParser(ColumnOptions(), SamplingParams())


def test_the_split_is_pinned_stable_and_covers_every_row_once(tmp_path: Path) -> None:
    # NOTE: pinned: a changed hash would move rows between shards of a job array in flight.
    assert [shard_of(k, 7) for k in ("a", "r0", "r1", "42", "héllo", "")] == [2, 6, 4, 1, 0, 0]
    assert shard_of("42", 1) == 0
    records: list[object] = [{"id": f"r{i}", "prompt": "p"} for i in range(300)]
    records += [{"id": i, "prompt": "p"} for i in range(300)]
    records += [{"id": 1.5, "prompt": "bad id"}, ["not", "an", "object"]]
    path = write_jsonl(tmp_path / "in.jsonl", records)
    (tmp_path / "in.jsonl").open("ab").write(b"{not json\n")
    reader = InputReader(path, None, ColumnOptions())
    for count in (1, 2, 3, 7):
        owners: dict[int, int] = {}
        for index in range(count):
            for row in reader.rows(PARSER, shard=Shard(index, count)):
                assert row.index not in owners, (count, row.index)
                owners[row.index] = index
        assert sorted(owners) == list(range(len(records) + 1)), count
        sizes = [list(owners.values()).count(i) for i in range(count)]
        assert min(sizes) > 0.7 * len(records) / count, sizes
        for index in range(count):
            scan = scan_input(reader, PARSER, shard=Shard(index, count))
            assert scan.num_rows == sizes[index] and scan.input_rows == len(records) + 1
    rng = random.Random(0)
    keyed = {row_key(r, i, PARSER): i for i, r in enumerate(records) if isinstance(r, dict)}
    shuffled = list(records[:600])
    rng.shuffle(shuffled)
    for position, record in enumerate(shuffled):
        assert isinstance(record, dict)
        key = row_key(record, position, PARSER)
        assert shard_of(key, 3) == shard_of(row_key(records[keyed[key]], keyed[key], PARSER), 3)


def test_row_keys_use_the_id_else_the_position() -> None:
    assert row_key({"id": "x"}, 5, PARSER) == "x"
    assert row_key({"custom_id": "req-1", "body": {}}, 5, PARSER) == "req-1"
    assert row_key({"id": 17}, 5, PARSER) == "17"
    assert row_key({"prompt": "no id column"}, 5, PARSER) == "5"
    assert row_key({"id": None}, 5, PARSER) == "#5"
    assert row_key(None, 6, PARSER) == "#6"
    by_column = RowParser(ColumnOptions(id_column="key"), SamplingParams())
    assert row_key({"id": "x", "key": "k"}, 0, by_column) == "k"


def test_shard_names_and_parsing() -> None:
    assert parse_shard("1/3", {}) == Shard(1, 3)
    assert str(Shard(1, 3)) == "1/3"
    assert Shard(1, 3).output_path(Path("d/out.parquet")) == Path("d/out.shard-1-of-3.parquet")
    assert shard_of_output(Path("d/out.shard-2-of-3.jsonl")) == Shard(2, 3)
    assert shard_of_output(Path("d/out.jsonl")) is None
    for bad in ("3/3", "-1/3", "1", "1/0", "a/3", "1/x", "auto/", "auto/0"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3"})


def test_shard_auto_reads_slurm_and_kubernetes() -> None:
    slurm = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert parse_shard("auto", slurm) == Shard(2, 3)
    assert parse_shard("auto/3", slurm) == Shard(2, 3)
    # --array=1-3: ids start at SLURM_ARRAY_TASK_MIN; --array=10-30:10: and step by _STEP.
    assert parse_shard("auto", {**slurm, "SLURM_ARRAY_TASK_MIN": "1"}) == Shard(1, 3)
    stepped = {"SLURM_ARRAY_TASK_ID": "30", "SLURM_ARRAY_TASK_MIN": "10"}
    stepped |= {"SLURM_ARRAY_TASK_STEP": "10", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert parse_shard("auto", stepped) == Shard(2, 3)
    with pytest.raises(ConfigError, match="not on the array's range"):
        parse_shard("auto", {**stepped, "SLURM_ARRAY_TASK_ID": "25"})
    with pytest.raises(ConfigError, match="environment says 3 tasks"):
        parse_shard("auto/4", slurm)
    with pytest.raises(ConfigError, match="out of range"):
        parse_shard("auto", {**slurm, "SLURM_ARRAY_TASK_ID": "3"})
    assert parse_shard("auto", {"JOB_COMPLETION_INDEX": "4", "VBATCH_SHARD_COUNT": "5"}) == Shard(
        4, 5
    )
    assert parse_shard("auto/5", {"JOB_COMPLETION_INDEX": "0"}) == Shard(0, 5)
    with pytest.raises(ConfigError, match="VBATCH_SHARD_COUNT is not"):
        parse_shard("auto", {"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(ConfigError, match="not an integer"):
        parse_shard("auto/2", {"JOB_COMPLETION_INDEX": "x"})
    with pytest.raises(ConfigError, match="neither is set"):
        parse_shard("auto", {})


def test_run_shard_auto_without_a_task_index_is_one_line(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--shard"]
    env = {"SLURM_ARRAY_TASK_ID": None, "JOB_COMPLETION_INDEX": None}
    result = CliRunner().invoke(app, [*args, "auto"], env=env)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --shard auto needs SLURM_ARRAY_TASK_ID")
    result = CliRunner().invoke(app, [*args, "0/2", "--clean"])
    assert result.exit_code == 1 and "--remove-shards" in result.output, result.output
    assert not list(tmp_path.glob("out*"))


def test_shards_on_disk_are_found_by_files_and_job_dirs(tmp_path: Path) -> None:
    output = tmp_path / "out[1].jsonl"
    assert shards_on_disk(output) == set()
    (tmp_path / "out[1].shard-0-of-3.jsonl").touch()
    (tmp_path / "out[1].shard-2-of-3.jsonl.vbatch").mkdir()
    (tmp_path / "out[1].shard-01-of-3.jsonl").touch()
    (tmp_path / "other.shard-0-of-4.jsonl").touch()
    (tmp_path / "out[1].shard-0-of-99999999999.jsonl").touch()
    (tmp_path / "out[1].shard-5-of-5.jsonl").touch()
    assert shards_on_disk(output) == {Shard(0, 3), Shard(2, 3)}
    (tmp_path / "out[1].shard-0-of-2.jsonl").touch()
    assert {s.count for s in shards_on_disk(output)} == {2, 3}


@pytest.mark.parametrize("text", ["0/10000000000", f"0/{MAX_SHARDS + 1}", "²/3", "0/³", "١/3"])
def test_absurd_counts_and_non_ascii_digits_are_refused_at_parse_time(text: str) -> None:
    with pytest.raises(ConfigError, match="--shard"):
        parse_shard(text, {})
    assert parse_shard(f"0/{MAX_SHARDS}", {}) == Shard(0, MAX_SHARDS)


def test_status_and_merge_never_walk_shard_numbers_without_a_file(tmp_path: Path) -> None:
    """A stray file of an absurd array is not a shard; a huge real array is checked by its
    files, the runs of missing shards reported as ranges (this took minutes per call)."""
    output = tmp_path / "out.jsonl"
    (tmp_path / "out.shard-0-of-99999999999.jsonl").touch()
    status = CliRunner().invoke(app, ["status", str(output)])
    assert status.exit_code == 1 and "there is no job for" in status.output, status.output
    result = CliRunner().invoke(app, ["merge", str(output)])
    assert result.exit_code == 1 and "there are no shards of" in result.output, result.output
    for index in (3, MAX_SHARDS - 1):
        (tmp_path / f"out.shard-{index}-of-{MAX_SHARDS}.jsonl.vbatch").mkdir()
    status = CliRunner().invoke(app, ["status", str(output)])
    assert status.exit_code == 0, status.output
    assert f"0 of {MAX_SHARDS} complete" in status.output
    assert f"0-2/{MAX_SHARDS}  not started" in status.output
    assert f"4-{MAX_SHARDS - 2}/{MAX_SHARDS}  not started" in status.output
    result = CliRunner().invoke(app, ["merge", str(output)])
    assert result.exit_code == 1, result.output
    assert f"shards 4-{MAX_SHARDS - 2}/{MAX_SHARDS}: not started; start each (I = 4 to" in (
        result.output
    )
    assert f"--shard I/{MAX_SHARDS}" in result.output
    assert f"shard 3/{MAX_SHARDS}: its job directory" in result.output


def test_a_slurm_list_array_is_told_to_use_shard_i_of_n() -> None:
    """`--array=1,5,9`: Slurm gives MIN 1, MAX 9, COUNT 3 and no step that fits; task 1 used
    to become shard 0 silently and tasks 5 and 9 fail with "shard 4 of 3"."""
    listed = {"SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "9"}
    listed |= {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_STEP": "1"}
    for task in ("1", "5", "9"):
        with pytest.raises(ConfigError, match="list arrays need --shard I/N"):
            parse_shard("auto", {**listed, "SLURM_ARRAY_TASK_ID": task})
    ranged = {**listed, "SLURM_ARRAY_TASK_STEP": "4", "SLURM_ARRAY_TASK_ID": "9"}
    assert parse_shard("auto", ranged) == Shard(2, 3)
