"""trainer/contract/trial_dir.py: a trial's files, read and written the one way every side uses."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainer.helpers import tiny_config
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkResult
from trainer.contract.trial_dir import (
    CONFIG_FILE,
    LAUNCH_FILE,
    LOG_FILE,
    RESULT_FILE,
    LaunchRecord,
    NoResult,
    load_result,
    log_tail,
    prepare,
    rank_failure_file,
    rank_failure_files,
    read_config,
    read_launch,
    read_result,
    with_log_tail,
    write_launch,
    write_result,
)

RESULT = BenchmarkResult(status="ok", step_times_s=[0.5, 0.25], tokens_per_s=1234.5, world_size=2)


def test_a_written_result_reads_back(tmp_path: Path) -> None:
    write_result(tmp_path / RESULT_FILE, RESULT)
    assert load_result(tmp_path) == read_result(tmp_path) == RESULT
    assert [p.name for p in tmp_path.iterdir()] == [RESULT_FILE]  # no temporary file left behind


def test_a_missing_result_is_told_apart_from_an_unreadable_one(tmp_path: Path) -> None:
    with pytest.raises(
        NoResult, match=f"^no result file {re.escape(str(tmp_path / RESULT_FILE))}$"
    ) as missing:
        load_result(tmp_path)
    assert missing.value.missing and read_result(tmp_path) is None

    (tmp_path / RESULT_FILE).write_text('{"status": "ok", "tokens_per')  # cut short
    with pytest.raises(NoResult, match=r"^unreadable result file .*result\.json: Unterminated string") as cut:
        load_result(tmp_path)
    assert not cut.value.missing and read_result(tmp_path) is None


def test_a_result_with_a_foreign_field_is_unreadable_and_says_which(tmp_path: Path) -> None:
    (tmp_path / RESULT_FILE).write_text('{"status": "ok", "tokens": 5}')
    with pytest.raises(NoResult, match=r"unknown field\(s\) \['tokens'\]") as e:
        load_result(tmp_path)
    assert not e.value.missing


def test_prepare_writes_the_config_and_clears_an_earlier_attempt(tmp_path: Path) -> None:
    work = tmp_path / "trial" / "1"
    cfg = tiny_config(ParallelConfig(dp_replicate=2, micro_batch_size=4))
    prepare(work, tiny_config(ParallelConfig()))
    write_result(work / RESULT_FILE, RESULT)
    write_launch(work, LaunchRecord(pid=1, start_time=1, host="n1", tag="t", timeout_s=60, started_at=0.0))
    (work / LOG_FILE).write_text("the first attempt's log\n")
    prepare(work, cfg)
    assert read_config(work) == cfg
    assert read_result(work) is None and read_launch(work) is None
    assert (work / LOG_FILE).exists()  # the log is its writer's: Slurm appends, the launcher starts afresh
    assert sorted(p.name for p in work.iterdir()) == [CONFIG_FILE, LOG_FILE]


def test_the_log_tail_is_the_end_of_the_log(tmp_path: Path) -> None:
    assert log_tail(tmp_path) == ""  # no log yet
    (tmp_path / LOG_FILE).write_text("start\n" + "x" * 10_000 + "\nTraceback: the end\n")
    assert log_tail(tmp_path, chars=19) == "Traceback: the end\n"
    assert len(log_tail(tmp_path)) == 3000
    assert with_log_tail("exit code 1", tmp_path, chars=4) == "exit code 1\n--- log tail ---\nend\n"


def test_the_log_tail_keeps_whole_characters(tmp_path: Path) -> None:
    """Read from the end in bytes: a multi-byte character cut at the start of what was read is
    not part of the tail."""
    (tmp_path / LOG_FILE).write_text("é" * 100 + "✓" * 3)  # 2 and 3 bytes each
    assert log_tail(tmp_path, chars=5) == "éé✓✓✓"
    (tmp_path / LOG_FILE).write_bytes(b"ok \xff\xfe done")  # not UTF-8: replaced, not an error
    assert log_tail(tmp_path) == "ok \ufffd\ufffd done"


def test_a_launch_record_reads_back_and_says_whether_the_supervisor_ended(tmp_path: Path) -> None:
    running = LaunchRecord(pid=42, start_time=7, host="n1", tag="trial-a", timeout_s=None, started_at=1.5)
    write_launch(tmp_path, running)
    assert read_launch(tmp_path) == running and not running.ended
    assert "exit_code" not in json.loads((tmp_path / LAUNCH_FILE).read_text())
    ended = replace(running, exit_code=0, ended_at=9.0)
    write_launch(tmp_path, ended)
    assert read_launch(tmp_path) == ended and ended.ended


@pytest.mark.parametrize("text", ['{"pid": 4', "[1, 2]", '{"pid": 4}', '{"pid": 4, "host": "n1", "shoe": 1}'])
def test_a_launch_record_that_is_unreadable_is_none(tmp_path: Path, text: str) -> None:
    assert read_launch(tmp_path) is None
    (tmp_path / LAUNCH_FILE).write_text(text)  # cut short, not an object, fields missing or foreign
    assert read_launch(tmp_path) is None


def test_rank_failure_files_sit_beside_their_result(tmp_path: Path) -> None:
    out = tmp_path / "run.result.json"
    paths = [rank_failure_file(out, rank) for rank in (3, 0)]
    for path in paths:
        path.write_text("{}")
    rank_failure_file(tmp_path / RESULT_FILE, 1).write_text("{}")  # another result's
    assert paths[1].name == "run.result.json.rank0.fail.json"
    assert rank_failure_files(out) == sorted(paths)
