"""What each input row asks of the engine, worked out once per row: its sampling parameters, its prompt's token ids
and the work it can cost; and the read that keeps one shard's rows, which the job runs and the data-parallel parent
runs to weigh the input for its ranks (runners/parent_split.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from batchgen.config import Config
from batchgen.engine.continuation import PREFILL_ONLY, encode_pair
from batchgen.engine.detokenizer import Detokenizer
from batchgen.io.openai_batch import model_name
from batchgen.io.readers import PromptRow, iter_prompts
from batchgen.io.shard_split import ShardSplit
from batchgen.sample.params import RowParams, SamplingParams

TOKENIZE_CHUNK_ROWS = 1024  # rows per batched tokenizer call: few calls, a bounded batch of encodings


class RowWork:
    """A job's view of its rows (task, sampling defaults, tokenizer): each row's parameters and prompt tokens."""

    def __init__(self, task: str, sampling: SamplingParams, detokenizer: Detokenizer | None):
        self.task = task
        self.detokenizer = detokenizer
        self._params_of = RowParams(sampling)

    def tokenize(self, rows: list[PromptRow]) -> None:
        """Tokenizes the text prompts of rows without token ids, in chunks of batched calls (the ids one call per
        row would give); a score row's pair is tokenized on its own (score_token_ids)."""
        if self.detokenizer is None or self.task == "score":
            return
        untokenized = [row for row in rows if row.prompt_token_ids is None]
        for start in range(0, len(untokenized), TOKENIZE_CHUNK_ROWS):
            chunk = untokenized[start:start + TOKENIZE_CHUNK_ROWS]
            for row, token_ids in zip(chunk, self.detokenizer.encode_batch([row.prompt for row in chunk]), strict=True):
                row.prompt_token_ids = token_ids

    def params(self, row: PromptRow) -> SamplingParams | None:
        """The row's sampling parameters; None for a row that is an error, or whose overrides are invalid: that
        sets its error, so it becomes an error row naming the row and the option."""
        if row.error is not None:
            return None
        if self.task != "generate":
            return PREFILL_ONLY  # nothing is generated; sampling options mean nothing
        try:
            return self._params_of(row.overrides, row.index)
        except ValueError as exc:
            row.error = str(exc)
            return None

    def estimated_work(self, row: PromptRow, params: SamplingParams | None) -> int:
        """What the row can cost: its prompt tokens plus max_tokens for each sample (0 for a row that fails)."""
        if params is None:
            return 0
        return self.num_prompt_tokens(row, params) + params.n * params.max_tokens

    def num_prompt_tokens(self, row: PromptRow, params: SamplingParams) -> int:
        """The prompt's length as the engine takes it. A text row is tokenized here, once: the engine takes its ids."""
        if self.task == "score":
            context_ids, continuation_ids = self.score_token_ids(row) or ([], [])
            return max(1, len(context_ids)) + len(continuation_ids)  # an empty context is the prefix token
        if row.prompt_token_ids is None and self.detokenizer is not None:
            row.prompt_token_ids = self.detokenizer.encode(row.prompt)
        num_prompt_tokens = len(row.prompt_token_ids or ())
        if params.truncate_prompt_tokens is not None:
            num_prompt_tokens = min(num_prompt_tokens, params.truncate_prompt_tokens)
        return num_prompt_tokens

    def score_token_ids(self, row: PromptRow) -> tuple[list[int], list[int]] | None:
        """A score row's context and continuation tokens, tokenized here once as lm-eval pairs them; None for texts
        without a tokenizer."""
        if row.continuation_token_ids is None:
            if self.detokenizer is None:
                return None
            row.prompt_token_ids, row.continuation_token_ids = encode_pair(self.detokenizer.tokenizer, row.prompt,
                                                                           row.continuation)
        return row.prompt_token_ids, row.continuation_token_ids


def open_input(config: Config) -> tuple[RowWork, Iterator[PromptRow]]:
    """The job's RowWork (the model's tokenizer loaded, None where the checkpoint has none) and its input rows, read
    as they are asked for; input problems surface at the first row."""
    work = RowWork(config.job.task, config.sampling, Detokenizer.load(config.model))
    tokenizer = work.detokenizer.tokenizer if work.detokenizer else None
    return work, iter_prompts(config.data, tokenizer, model_name(config.model), work.task)


@dataclass
class Shard:
    """One shard's rows as read_shard keeps them, with what the shard marker records of the whole input."""

    rows: list[PromptRow]
    params: dict[int, SamplingParams]  # each own row's sampling parameters (none for an error row)
    num_input_rows: int
    split_digest: str


def read_shard(rows: Iterable[PromptRow], split: ShardSplit, shard_index: int, work: RowWork) -> Shard:
    """The rows of shard `shard_index` under `split`, keeping no other row; each own row's parameters are computed
    once (a row whose overrides are invalid becomes an error row instead). A split that weighs rows by their work
    tokenizes every row of the input: a chunk of rows at a time, in one batched call, so that a shard's read costs
    about what the whole job's tokenizing does. A shard_index no shard has keeps nothing: the split is then all that
    the read computes (ShardSplit's `record`)."""
    weigh = split.weighs
    own = []
    params_of_own: dict[int, SamplingParams] = {}
    num_input_rows = 0
    rows = iter(rows)
    while chunk := list(islice(rows, TOKENIZE_CHUNK_ROWS)):
        num_input_rows += len(chunk)
        if weigh:
            work.tokenize([row for row in chunk if row.error is None])
        for row in chunk:
            params = work.params(row) if weigh else None
            if split.shard_of(row.index, work.estimated_work(row, params) if weigh else 0) == shard_index:
                own.append(row)
                if not weigh:
                    params = work.params(row)
                if params is not None:
                    params_of_own[row.index] = params
    split.check_complete()
    return Shard(own, params_of_own, num_input_rows, split.digest)
