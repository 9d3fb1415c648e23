"""The data-parallel parent's split of the input: the parent's weighing is the split each shard computes on its own, a
rank takes it without tokenizing the whole input, and a rank whose parent gave none weighs the input itself."""

from __future__ import annotations

import json
import threading
from array import array
from pathlib import Path

import pytest

from batchgen.io.errors import InputError
from batchgen.io.shard_split import ShardSplit
from batchgen.job.row_work import RowWork
from batchgen.runners import parent_split
from batchgen.runners.parent_split import PARENT_SPLIT_ENV, ParentSplit, wait_for_parent_split, weigh_input
from tests.cli.test_config import composed


def write_rows(path: Path, num_rows: int = 23) -> Path:
    lines = [{"id": index, "prompt": "ROMEO " * (1 + index % 5) + str(index), "max_tokens": 1 + 7 * (index % 3)}
             for index in range(num_rows)]
    lines[5] = {"id": 5}  # no prompt: an error row
    lines[9]["max_tokens"] = -1  # an invalid override: an error row
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def split_of(num_shards: int, given: array) -> tuple[list[int], str]:
    """The shards a split given `given` hands out over its rows, and its digest."""
    split = ShardSplit(num_shards, "work", given=given)
    return [split.shard_of(index, 0) for index in range(len(given))], split.digest


def shard_config(prompts: Path, num_shards: int = 1, shard_index: int = 0, *overrides: str):
    return composed("job=shakespeare", f"data.path={prompts}", f"data.num_shards={num_shards}",
                    f"data.shard_index={shard_index}", "data.on_error=skip", "engine.device=cpu", *overrides)


def test_the_parents_weighing_is_the_split_each_shard_computes_on_its_own(tmp_path):
    from batchgen.job.run import Job  # after tests.cli.test_config: the job imports the engine's modules

    prompts = write_rows(tmp_path / "prompts.jsonl")
    weighed = weigh_input(shard_config(prompts), 3)  # the parent's own config: one shard, the data-parallel size apart
    jobs = [Job(shard_config(prompts, 3, i), tmp_path / str(i)) for i in range(3)]
    assert [[row.index for row in job.rows] for job in jobs] == [
        [index for index, shard in enumerate(weighed) if shard == i] for i in range(3)]
    shards, digest = split_of(3, weighed)
    assert shards == list(weighed)
    assert all(job.split_digest == digest and job.num_input_rows == 23 for job in jobs)


def test_a_rank_takes_the_given_split_without_tokenizing_the_whole_input(tmp_path, monkeypatch):
    from batchgen.job.run import Job

    prompts = write_rows(tmp_path / "prompts.jsonl")
    tokenized: list[int] = []
    real_tokenize = RowWork.tokenize
    monkeypatch.setattr(RowWork, "tokenize", lambda self, rows: tokenized.extend(r.index for r in rows)
                        or real_tokenize(self, rows))
    # An assignment no weighing gives (rows 0-19 to shard 1): the rank must follow it, not its own weighing.
    given = array("i", [1] * 20 + [0] * 3)
    job = Job(shard_config(prompts, 2, 1), tmp_path / "rank", lambda: given)
    assert [row.index for row in job.rows] == list(range(20))
    assert tokenized == []  # the parent weighed: nothing was tokenized to split the rows
    assert job.split_digest == split_of(2, given)[1] != Job(
        shard_config(prompts, 2, 1), tmp_path / "alone").split_digest
    assert "max_tokens" in job.rows[9].error  # the own rows' parameters are still checked
    # A split by index never asks for the parent's split.
    Job(shard_config(prompts, 2, 1, "data.shard_by=index"), tmp_path / "index", lambda: pytest.fail("asked"))


@pytest.mark.parametrize("num_given", [22, 24])
def test_a_given_split_that_does_not_cover_the_input_is_an_error_naming_it(tmp_path, num_given):
    from batchgen.job.run import Job

    prompts = write_rows(tmp_path / "prompts.jsonl")
    with pytest.raises(InputError, match=rf"{prompts}: the given split covers {num_given} rows.*input change"):
        Job(shard_config(prompts, 2, 0), tmp_path / "rank", lambda: array("i", [0] * num_given))


def test_a_rank_waits_for_the_parents_split_until_the_parent_closes_its_pipe(tmp_path, monkeypatch):
    prompts = write_rows(tmp_path / "prompts.jsonl")
    split = ParentSplit(tmp_path)
    monkeypatch.setenv(PARENT_SPLIT_ENV, split.child_env()[PARENT_SPLIT_ENV])  # this process plays the rank
    taken: list[array | None] = []
    rank = threading.Thread(target=lambda: taken.append(wait_for_parent_split()))
    rank.start()
    assert not taken  # the pipe is open: the rank waits
    split.publish(shard_config(prompts), 3)
    rank.join()
    assert taken == [weigh_input(shard_config(prompts), 3)]
    split.remove()
    assert not split.path.exists()


def test_a_rank_weighs_the_input_itself_where_the_parent_could_not(tmp_path, monkeypatch, caplog):
    split_file = tmp_path / parent_split.SPLIT_FILE
    split_file.write_bytes(array("i", [0] * 23).tobytes())  # an earlier attempt's: never taken for this one's
    split = ParentSplit(tmp_path)
    monkeypatch.setenv(PARENT_SPLIT_ENV, split.child_env()[PARENT_SPLIT_ENV])

    def unreadable(config, num_shards):
        raise InputError("prompts.jsonl: no such file")

    monkeypatch.setattr(parent_split, "weigh_input", unreadable)
    split.publish(composed("job=shakespeare"), 2)
    assert "Could not weigh the input for the ranks (InputError: prompts.jsonl: no such file)" in caplog.text
    assert wait_for_parent_split() is None
    monkeypatch.delenv(PARENT_SPLIT_ENV)
    assert wait_for_parent_split() is None  # a rank without a parent's pipe (torchrun) weighs on its own
