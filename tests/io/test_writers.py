import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io import writers
from batchgen.io.schema import COMPLETIONS_SCHEMA, STEPS_SCHEMA, read_metadata
from batchgen.io.writers import CompletionWriter, DuplicateRowError, StepWriter, dictionary_columns, write_json_atomic
from batchgen.job.run import TASK_COLUMNS

REPO_ROOT = Path(__file__).resolve().parents[2]
METADATA = {"config": {"data": {"path": "prompts.jsonl"}, "seed": 0}, "versions": {"batchgen": "0.1.0"}}


def completion(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"id-{index}",
        "prompt": f"prompt {index}",
        "completion": f"completion {index}",
        "prompt_token_ids": [1, 2, index],
        "output_token_ids": [index, 4],
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
        "finish_reason": "length",
        "ttft_ms": 1.5,
        "tpot_ms": 0.25,
        "latency_ms": 2.0,
        "sample_index": 0,
        "num_cached_tokens": 0,
    }


def error_completion(index: int) -> dict[str, Any]:
    return {"index": index, "id": f"id-{index}", "finish_reason": "error", "error": "line 3: invalid JSON"}


def step(attempt: int, number: int) -> dict[str, Any]:
    return {
        "step": number,
        "attempt": attempt,
        "kind": "decode",
        "num_seqs": 4,
        "num_tokens": 4,
        "num_prefill_tokens": 0,
        "num_decode_tokens": 4,
        "padded_size": 8,
        "cuda_graph": True,
        "cascade_attention": False,
        "schedule_ms": 0.1,
        "prepare_ms": 0.2,
        "forward_ms": 3.0,
        "sample_ms": 0.3,
        "wait_ms": 2.9,
        "step_ms": 3.6,
        "kv_blocks_used": 10,
        "kv_blocks_total": 100,
        "num_waiting": 0,
        "num_running": 4,
        "num_preempted": 0,
        "num_cached_tokens": 0,
    }


def uninterrupted_run(run_dir: Path, count: int) -> list[dict[str, Any]]:
    writer = CompletionWriter(run_dir, METADATA)
    for index in range(count):
        writer.write(completion(index))
    return pq.read_table(writer.close()).to_pylist()


def part_files(writer: CompletionWriter | StepWriter) -> list[Path]:
    return sorted(writer.parts_dir.glob("part-*.parquet"))


def test_completions_schema_and_metadata_round_trip(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA)
    writer.write(completion(0))
    writer.write(error_completion(1))
    path = writer.close()

    assert path == tmp_path / "completions.parquet"
    table = pq.read_table(path)
    assert table.schema.equals(COMPLETIONS_SCHEMA)
    assert read_metadata(path) == METADATA
    # Columns of other tasks (score, embed, classify) are null.
    assert table.to_pylist()[0] == {**completion(0), "error": None, "logprobs": None, "prompt_logprobs": None,
                                    **dict.fromkeys(TASK_COLUMNS)}
    frame = pd.read_parquet(path)
    assert list(frame.columns) == COMPLETIONS_SCHEMA.names
    assert frame.loc[1, "finish_reason"] == "error"
    assert frame.loc[1, "error"] == "line 3: invalid JSON"
    assert pd.isna(frame.loc[1, "ttft_ms"]) and pd.isna(frame.loc[1, "completion"])
    assert list(frame.loc[0, "output_token_ids"]) == [0, 4]
    assert not writer.parts_dir.exists()


def test_steps_schema_and_metadata_round_trip(tmp_path: Path) -> None:
    writer = StepWriter(tmp_path, METADATA)
    writer.write(step(0, 0))
    writer.write({**step(0, 1), "padded_size": None, "cuda_graph": False, "kind": "prefill"})
    path = writer.close()

    assert path == tmp_path / "steps.parquet"
    assert pq.read_table(path).schema.equals(STEPS_SCHEMA)
    assert read_metadata(path) == METADATA
    frame = pd.read_parquet(path)
    assert list(frame["kind"]) == ["decode", "prefill"]
    assert pd.isna(frame.loc[1, "padded_size"]) and not frame.loc[1, "cuda_graph"]


def test_rows_are_sorted_by_index_after_out_of_order_writes(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in [5, 2, 0, 4, 1, 3]:
        writer.write(completion(index))
    assert pq.read_table(writer.close()).column("index").to_pylist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(("first_budget", "then_budget", "reads"),
                         [(1 << 20, 1 << 20, 1), (0, 0, 4), (1 << 20, 0, 3)], ids=["all kept", "none kept", "one kept"])
def test_close_merges_the_parts_it_kept_in_memory_and_reads_the_rest(tmp_path: Path, monkeypatch, first_budget: int,
                                                                     then_budget: int, reads: int) -> None:
    """A resumed attempt: the earlier attempt's part, and the parts past the byte budget, are read back; the parts it
    kept are not."""
    earlier = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    earlier.write(completion(6))
    earlier.wait_for_parts()
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    monkeypatch.setattr(writers, "KEPT_PART_BYTES", first_budget)
    for index in [5, 2]:
        writer.write(completion(index))
    monkeypatch.setattr(writers, "KEPT_PART_BYTES", then_budget)
    for index in [0, 4, 1, 3]:
        writer.write(completion(index))
    writer.wait_for_parts()
    earlier_part = part_files(writer)[0]
    read = []
    parquet_file = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda path: read.append(Path(path)) or parquet_file(path))

    path = writer.close()

    assert pq.read_table(path).to_pylist() == uninterrupted_run(tmp_path / "reference", 7)
    assert len(read) == reads and read[0] == earlier_part


OUT_OF_ORDER = [1, 0, 3, 5, 2, 4, 6]


@pytest.mark.parametrize(("indices", "marks", "merged"), [
    ([0, 1, 2, 3, 4, 5, 6], {}, False), ([1, 0, 2, 3, 4, 5, 6], {}, True), ([0, 1, 3, 2, 4, 5, 6], {}, True),
    ([0, 1, 2, 3, 4, 6, 5], {}, True), (OUT_OF_ORDER, {1: 2, 5: 4, 4: 6}, False), (OUT_OF_ORDER, {1: 2, 3: 6}, True)],
    ids=["in order", "unsorted in a part", "unsorted across parts", "unsorted buffer", "rows below each mark written",
         "a row below its mark comes after it"])
def test_close_merges_only_rows_the_final_file_could_not_take_in_order(tmp_path: Path, monkeypatch,
                                                                       indices: list[int], marks: dict[int, int],
                                                                       merged: bool) -> None:
    """The final file grows as parts are written: by rows that come in order, or, once the job tells the writer
    below which index every row is written (the marks, after a row), by those rows, sorted, the rest held back.
    close() adds the rows still held and renames it, writing no row again; rows the order cannot take are merged."""
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in indices:
        writer.write(completion(index))
        if index in marks:
            writer.complete_below(marks[index])
    writer.wait_for_parts()
    written = []
    write_table = CompletionWriter._write_table
    monkeypatch.setattr(CompletionWriter, "_write_table",
                        lambda self, table, file: written.append(table.num_rows) or write_table(self, table, file))

    path = writer.close()

    assert written[-1:] == ([7] if merged else [])  # the merge writes every row again
    assert pq.read_table(path).to_pylist() == uninterrupted_run(tmp_path / "reference", 7)
    assert read_metadata(path) == METADATA and not writer.parts_dir.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_part_written_in_the_background_grows_the_final_file_by_the_rows_complete_when_it_was_flushed(
        tmp_path: Path, monkeypatch) -> None:
    """The writer's thread sorts a part's rows into the final file after writing the part; rows that came and
    completed meanwhile are not in the part, so the rows it may take are those complete at its flush, not later."""
    writing = threading.Event()
    release = threading.Event()
    write_table = CompletionWriter._write_table

    def held_write(self, table, file) -> None:
        if table.num_rows == 2:  # the background part; the close's writes go through
            writing.set()
            release.wait(timeout=60)  # bounded: a failure before the release must not leave the writer's thread waiting
        write_table(self, table, file)

    monkeypatch.setattr(CompletionWriter, "_write_table", held_write)
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    writer.write(completion(0))
    writer.complete_below(1)
    writer.write(completion(2))  # the part [0, 2], flushed with rows below 1 complete
    assert writing.wait(timeout=60)
    writer.write(completion(1))
    writer.complete_below(3)  # rows 0-2 complete now, while the part is being written
    release.set()
    writer.wait_for_parts()
    rewritten = []
    monkeypatch.setattr(CompletionWriter, "_write_table",
                        lambda self, table, file: rewritten.append(table.num_rows) or write_table(self, table, file))

    path = writer.close()

    assert pq.read_table(path).to_pylist() == uninterrupted_run(tmp_path / "reference", 3)
    assert rewritten == []  # the final file grew by row 0, then took the held row 2 after row 1: no merge


@pytest.mark.parametrize("flush_rows", [2, 100], ids=["parts", "no part"])
def test_steps_grow_the_final_file_in_write_order(tmp_path: Path, flush_rows: int) -> None:
    writer = StepWriter(tmp_path, METADATA, flush_rows=flush_rows)
    for number in [3, 1, 2, 0, 4]:
        writer.write(step(0, number))
    frame = pd.read_parquet(writer.close())
    assert frame["step"].tolist() == [3, 1, 2, 0, 4]
    assert read_metadata(tmp_path / "steps.parquet") == METADATA


def test_a_final_file_that_fails_to_grow_is_left_to_the_merge(tmp_path: Path, monkeypatch) -> None:
    """A write to the growing final file that fails (a file-size limit) gives it up: close() merges the parts."""
    grown = []
    write_table = pq.ParquetWriter.write_table

    def fail_the_second_growth(self, table, *args, **kwargs) -> None:
        if self is writer._final_rows:
            grown.append(table.num_rows)
            if len(grown) == 2:
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        write_table(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail_the_second_growth)
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in range(5):
        writer.write(completion(index))
    writer.wait_for_parts()
    assert not list(tmp_path.glob("*.tmp"))  # given up at once

    assert pq.read_table(writer.close()).to_pylist() == uninterrupted_run(tmp_path / "reference", 5)
    assert grown == [2, 2]  # the first two parts: after the failure the file grows no more


def test_float_columns_are_written_without_a_dictionary(tmp_path: Path) -> None:
    entry = {"token_id": 7, "text": "a", "logprob": -0.5, "rank": 1,
             "top": [{"token_id": 7, "text": "a", "logprob": -0.5}]}
    writer = CompletionWriter(tmp_path, METADATA)
    writer.write({**completion(0), "logprobs": [entry, entry], "prompt_logprobs": [None, entry]})
    path = writer.close()

    columns = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {columns.column(i).path_in_schema: columns.column(i).has_dictionary_page
                  for i in range(columns.num_columns)}
    assert set(dictionary_columns(COMPLETIONS_SCHEMA)) <= dictionary.keys()  # the paths name the file's columns
    floats = {"ttft_ms", "tpot_ms", "latency_ms", "logprobs.list.element.logprob",
              "logprobs.list.element.top.list.element.logprob", "prompt_logprobs.list.element.logprob",
              "prompt_logprobs.list.element.top.list.element.logprob", "continuation_logprob",
              "embedding.list.element", "logits.list.element", "probs.list.element", "score"}
    without = {path for path, has_dictionary in dictionary.items() if not has_dictionary}
    assert without == floats | {"continuation_is_greedy"}  # Parquet has no dictionary of booleans
    assert pq.read_table(path).to_pylist()[0]["prompt_logprobs"] == [None, entry]


def test_parts_flushed_by_row_count_are_readable_before_close(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in range(5):
        writer.write(completion(index))
    writer.wait_for_parts()

    parts = part_files(writer)
    assert len(parts) == 2
    assert [pq.read_table(part).column("index").to_pylist() for part in parts] == [[0, 1], [2, 3]]
    assert pd.read_parquet(writer.parts_dir)["index"].tolist() == [0, 1, 2, 3]
    assert writer.existing_rows().num_rows == 4


def test_a_part_flushed_by_row_count_is_written_on_the_writers_thread(tmp_path: Path, monkeypatch) -> None:
    """Rows keep coming while a full part is encoded and written; flush() writes the rest on the caller's thread."""
    writing_threads = []
    write_table = CompletionWriter._write_table

    def recording_thread(self, *args) -> None:
        writing_threads.append(threading.current_thread())
        write_table(self, *args)

    monkeypatch.setattr(CompletionWriter, "_write_table", recording_thread)
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in range(3):
        writer.write(completion(index))
    writer.flush()

    assert writing_threads[0] is not threading.current_thread() and writing_threads[1] is threading.current_thread()
    assert [pq.read_table(part).column("index").to_pylist() for part in part_files(writer)] == [[0, 1], [2]]


def test_the_rows_of_a_part_flushed_by_row_count_are_sorted_into_the_final_file_on_the_writers_thread(
        tmp_path: Path, monkeypatch) -> None:
    """Sorting a flushed part's rows (with those held back) is not the job's pause between its steps."""
    sorting_threads = []
    rows_to_grow = CompletionWriter._rows_to_grow

    def recording_thread(self, *args, **kwargs):
        sorting_threads.append(threading.current_thread())
        return rows_to_grow(self, *args, **kwargs)

    monkeypatch.setattr(CompletionWriter, "_rows_to_grow", recording_thread)
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    for index in (1, 0):
        writer.write(completion(index))
        writer.complete_below(0 if index else 2)
    writer.wait_for_parts()

    assert sorting_threads and threading.current_thread() not in sorting_threads
    assert pq.read_table(writer.close()).to_pylist() == uninterrupted_run(tmp_path / "reference", 2)


def test_a_part_that_failed_in_the_background_is_written_by_the_next_flush(tmp_path: Path, monkeypatch) -> None:
    """A background write that fails (a full disk) raises at the writer's next flush, and its rows are not lost: the
    flush after writes them, before the rows that came after."""
    failures = [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))]
    write_part = CompletionWriter._write_part

    def fill_the_disk_once(self, *part) -> None:
        if failures:
            raise failures.pop()
        write_part(self, *part)

    monkeypatch.setattr(CompletionWriter, "_write_part", fill_the_disk_once)
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=2)
    writer.write(completion(0))
    writer.write(completion(1))  # its part fails on the writer's thread
    writer.write(completion(2))
    with pytest.raises(OSError, match="No space left"):
        writer.write(completion(3))  # the next part's flush
    assert part_files(writer) == []
    writer.flush()

    assert [pq.read_table(part).column("index").to_pylist() for part in part_files(writer)] == [[0, 1], [2, 3]]
    assert pq.read_table(writer.close()).to_pylist() == uninterrupted_run(tmp_path / "reference", 4)


def test_a_resumed_writer_merges_earlier_parts_under_its_own_metadata(tmp_path: Path) -> None:
    first = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    first.write(completion(0))
    first.wait_for_parts()
    resumed_metadata = {**METADATA, "resume_forced": {"differences": {"seed": [0, 5]}}}
    resumed = CompletionWriter(tmp_path, resumed_metadata, flush_rows=1)
    resumed.write(completion(1))
    path = resumed.close()
    assert read_metadata(path) == resumed_metadata
    assert pq.read_table(path).column("index").to_pylist() == [0, 1]


def test_parts_are_flushed_by_time(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=1000, flush_seconds=0.0)
    writer.write(completion(0))
    writer.wait_for_parts()
    assert len(part_files(writer)) == 1


def test_resume_after_a_crash_gives_the_uninterrupted_result(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    crashed = CompletionWriter(run_dir, METADATA, flush_rows=2)
    for index in [0, 3, 1, 2, 4]:
        crashed.write(completion(index))
    crashed.wait_for_parts()
    # Abandoned without close(): the row of index 4 was still buffered and is lost, as after a SIGKILL.
    (crashed.parts_dir / "part-000002.parquet.tmp").write_bytes(b"half a parquet file")
    (run_dir / "completions.parquet.tmp").write_bytes(b"half a merged file")
    del crashed

    resumed = CompletionWriter(run_dir, METADATA, flush_rows=2)
    assert resumed.finished_indices() == {0, 1, 2, 3}
    assert not list(run_dir.rglob("*.tmp"))
    for index in range(10):
        if index not in resumed.finished_indices():
            resumed.write(completion(index))
    merged = pq.read_table(resumed.close())

    assert merged.to_pylist() == uninterrupted_run(tmp_path / "reference", 10)
    assert read_metadata(run_dir / "completions.parquet") == METADATA


def test_resume_after_a_finished_run_rebuilds_from_parts(tmp_path: Path) -> None:
    first = CompletionWriter(tmp_path, METADATA)
    for index in range(3):
        first.write(completion(index))
    first.close()

    resumed = CompletionWriter(tmp_path, METADATA)
    assert not (tmp_path / "completions.parquet").exists()
    assert resumed.finished_indices() == {0, 1, 2}
    resumed.write(completion(3))
    assert pq.read_table(resumed.close()).column("index").to_pylist() == [0, 1, 2, 3]


def test_resume_after_a_close_killed_before_removing_the_parts(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    for index in range(3):
        writer.write(completion(index))
    writer.wait_for_parts()
    leftover = {part.name: part.read_bytes() for part in part_files(writer)}
    final_path = writer.close()
    writer.parts_dir.mkdir()
    for name, content in leftover.items():
        (writer.parts_dir / name).write_bytes(content)

    resumed = CompletionWriter(tmp_path, METADATA)
    assert resumed.existing_rows().column("index").to_pylist() == [0, 1, 2]
    assert pq.read_table(resumed.close()).num_rows == 3
    assert final_path.exists()


def test_an_index_is_written_once(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    writer.write(completion(0))
    with pytest.raises(DuplicateRowError, match="index 0 was already written"):
        writer.write(completion(0))
    writer.flush()

    resumed = CompletionWriter(tmp_path, METADATA)
    with pytest.raises(DuplicateRowError, match="index 0"):
        resumed.write(completion(0))


def test_close_rejects_duplicates_and_keeps_the_parts(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    writer.write(completion(0))
    writer.write(completion(1))
    writer.wait_for_parts()
    [first_part, _] = part_files(writer)
    (writer.parts_dir / "part-000009.parquet").write_bytes(first_part.read_bytes())

    with pytest.raises(DuplicateRowError, match=r"more than once: \[0\]"):
        writer.close()
    assert len(part_files(writer)) == 3
    assert not (tmp_path / "completions.parquet").exists()


def test_records_are_checked_against_the_schema(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA)
    with pytest.raises(ValueError, match=r"unknown fields \['completion_text'\]"):
        writer.write({**completion(0), "completion_text": "typo"})
    with pytest.raises(ValueError, match=r"required fields \['finish_reason'\]"):
        writer.write({**completion(0), "finish_reason": None})
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(completion(1))


def test_steps_keep_write_order_across_attempts(tmp_path: Path) -> None:
    first = StepWriter(tmp_path, METADATA, flush_rows=2)
    assert first.next_attempt() == 0
    for number in range(3):
        first.write(step(0, number))
    first.flush()
    del first  # killed after its last flush

    second = StepWriter(tmp_path, METADATA)
    assert second.next_attempt() == 1
    for number in range(2):
        second.write(step(1, number))
    frame = pd.read_parquet(second.close())
    assert list(zip(frame["attempt"], frame["step"], strict=True)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert StepWriter(tmp_path, METADATA).next_attempt() == 2


def test_write_json_atomic(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"rows": 1})
    write_json_atomic(path, {"rows": 2, "errors": []})
    assert json.loads(path.read_text()) == {"rows": 2, "errors": []}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


KILLED_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from batchgen.io.writers import CompletionWriter
    from tests.io.test_writers import METADATA, completion

    writer = CompletionWriter(Path(sys.argv[1]), METADATA, flush_rows=3)
    for index in range(1000):
        writer.write(completion(index))
        time.sleep(0.002)
    """
)


@pytest.mark.slow  # the child process imports batchgen, and with it torch
def test_a_sigkilled_job_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    job = subprocess.Popen([sys.executable, "-c", KILLED_JOB, str(run_dir)], cwd=REPO_ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list((run_dir / "completions.parts").glob("part-*.parquet"))) < 4:
            assert job.poll() is None and time.monotonic() < deadline, "the job stopped before writing parts"
            time.sleep(0.01)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()

    resumed = CompletionWriter(run_dir, METADATA, flush_rows=50)
    done = resumed.finished_indices()
    assert len(done) >= 12 and done == set(range(len(done)))
    for index in range(1000):
        if index not in done:
            resumed.write(completion(index))
    assert pq.read_table(resumed.close()).to_pylist() == uninterrupted_run(tmp_path / "reference", 1000)


def test_samples_of_a_row_sort_by_index_then_sample_and_a_row_is_finished_when_all_are(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA, flush_rows=1)
    for index, sample_index in [(1, 1), (0, 2), (1, 0), (0, 0)]:
        writer.write({**completion(index), "sample_index": sample_index})
    with pytest.raises(DuplicateRowError, match="index 1 was already written"):
        writer.write({**completion(1), "sample_index": 1})
    writer.wait_for_parts()
    resumed = CompletionWriter(tmp_path, METADATA)
    assert resumed.finished_samples() == {0: {0, 2}, 1: {0, 1}}
    assert resumed.finished_indices(lambda index: 2) == {1}
    assert resumed.finished_indices() == {0, 1}
    resumed.write({**completion(0), "sample_index": 1})
    table = pq.read_table(resumed.close())
    assert list(zip(table["index"].to_pylist(), table["sample_index"].to_pylist(), strict=True)) == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_a_part_holds_the_rows_from_pylist_would_build(tmp_path: Path) -> None:
    """Columns built one at a time (nulls for a column no row sets, a nested value given as a one-row Array) hold
    what pa.Table.from_pylist builds from the same records."""
    records = [completion(0), error_completion(1), {**completion(2), "embedding": [0.5, 1.5], "label": "yes"},
               {**completion(3), "output_token_ids": pa.array([[7, 8]], pa.list_(pa.int32())), "score": 2.0}]
    writer = CompletionWriter(tmp_path, METADATA)
    for record in records:
        writer.write(record)  # sets a missing sample_index to 0
    table = pq.read_table(writer.close())

    records[3]["output_token_ids"] = [7, 8]
    assert table.equals(pa.Table.from_pylist(records, schema=table.schema))


@pytest.mark.parametrize("mixed", [False, True])
def test_token_ids_given_as_numpy_arrays_write_what_lists_write(tmp_path: Path, mixed: bool) -> None:
    """A list column whose values are int64 numpy arrays (the engine's prompt arrays; views of one array, an empty
    one, an error row's None) is the column their lists make; beside a list value (mixed) too."""
    prompts = np.arange(10, 20, dtype=np.int64)
    records = [{**completion(0), "prompt_token_ids": prompts[:4]}, error_completion(1),
               {**completion(2), "prompt_token_ids": prompts[4:4]},
               {**completion(3), "prompt_token_ids": [9, 9] if mixed else prompts[4:]}]
    as_lists = [{**record, "prompt_token_ids": list(map(int, record["prompt_token_ids"]))}
                if "prompt_token_ids" in record else record for record in records]
    expected = writers.records_table([tuple(map(record.get, COMPLETIONS_SCHEMA.names)) for record in as_lists],
                                     COMPLETIONS_SCHEMA)
    written = writers.records_table([tuple(map(record.get, COMPLETIONS_SCHEMA.names)) for record in records],
                                    COMPLETIONS_SCHEMA)
    assert written.equals(expected)
    last = as_lists[3]["prompt_token_ids"]
    assert written.column("prompt_token_ids").to_pylist() == [[10, 11, 12, 13], None, [], last]

    too_large = {**completion(4), "prompt_token_ids": np.array([2**31], dtype=np.int64)}
    with pytest.raises(pa.ArrowInvalid, match="not in range"):
        writers.records_table([tuple(map(too_large.get, COMPLETIONS_SCHEMA.names))], COMPLETIONS_SCHEMA)


def test_a_record_changed_after_its_write_is_written_as_it_was(tmp_path: Path) -> None:
    writer = CompletionWriter(tmp_path, METADATA)
    record = completion(0)
    writer.write(record)
    record["completion"] = "changed"
    assert pq.read_table(writer.close()).column("completion").to_pylist() == ["completion 0"]


def test_values_in_schema_order_write_what_the_record_writes(tmp_path: Path) -> None:
    """write_values (a row's values as a tuple in the schema's order) writes the part write() writes from the
    record, missing sample_index aside (write sets it to 0), and checks the same things."""
    records = [completion(0), error_completion(1), {**completion(2), "embedding": [0.5, 1.5], "label": "yes"},
               {**completion(3), "output_token_ids": pa.array([[7, 8]], pa.list_(pa.int32())), "score": 2.0},
               {**completion(1), "sample_index": 1}]
    by_record = CompletionWriter(tmp_path / "record", METADATA)
    by_values = CompletionWriter(tmp_path / "values", METADATA)
    for record in records:
        by_record.write(dict(record))
        by_values.write_values(tuple({"sample_index": 0, **record}.get(name) for name in COMPLETIONS_SCHEMA.names))
    assert pq.read_table(by_values.close()).equals(pq.read_table(by_record.close()))

    writer = CompletionWriter(tmp_path / "checked", METADATA)
    values = tuple(completion(0).get(name) for name in COMPLETIONS_SCHEMA.names)
    finish_reason = COMPLETIONS_SCHEMA.get_field_index("finish_reason")
    with pytest.raises(ValueError, match=r"required fields \['finish_reason'\]"):
        writer.write_values(values[:finish_reason] + (None,) + values[finish_reason + 1:])
    with pytest.raises(ValueError, match="a row has 3 values"):
        writer.write_values(values[:3])
    writer.write_values(values)
    with pytest.raises(DuplicateRowError, match="index 0 was already written"):
        writer.write_values(values)
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_values(tuple(completion(1).get(name) for name in COMPLETIONS_SCHEMA.names))


@pytest.mark.parametrize("convert_rows", [1, 3, 8])
def test_rows_converted_a_piece_at_a_time_write_what_one_conversion_writes(tmp_path: Path, monkeypatch,
                                                                          convert_rows: int) -> None:
    """Buffered rows become Arrow CONVERT_ROWS at a time as they come: the parts (flushed by count, mid-piece or on
    a piece's end) and the final file hold the rows one conversion of all of them gives, in order."""
    order = [11, 3, 0, 7, 1, 9, 4, 12, 2, 10, 5, 8, 6, 13]
    records = [error_completion(index) if index % 5 == 0 else
               {**completion(index), "prompt_token_ids": np.arange(index, dtype=np.int64), "label": f"l{index}"}
               for index in order]
    monkeypatch.setattr(writers, "CONVERT_ROWS", convert_rows)
    writer = CompletionWriter(tmp_path / "pieces", METADATA, flush_rows=6)
    for record in records:
        writer.write(record)
    writer.wait_for_parts()  # the second part is written on the writer's thread
    parts_dir = tmp_path / "pieces" / "completions.parts"
    parts = [pq.read_table(part).num_rows for part in sorted(parts_dir.glob("*.parquet"))]
    table = pq.read_table(writer.close())

    monkeypatch.setattr(writers, "CONVERT_ROWS", len(records))
    whole = CompletionWriter(tmp_path / "whole", METADATA, flush_rows=len(records))
    for record in records:
        whole.write(record)
    assert parts == [6, 6]
    assert table.column("index").to_pylist() == sorted(order)
    assert table.equals(pq.read_table(whole.close()))
