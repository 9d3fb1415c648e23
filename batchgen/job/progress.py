"""Live progress: a tqdm bar (requests done, prompt and output tok/s) and a log line every few seconds."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

from batchgen.config import JobConfig
from batchgen.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, done: int, config: JobConfig):
        interactive = sys.stderr.isatty()
        # Without a terminal tqdm cannot redraw in place; one line per log interval keeps CI logs readable.
        self.bar = tqdm(total=total, initial=done, unit="req", desc="requests", disable=not config.progress,
                        mininterval=0.5 if interactive else config.log_every_seconds, dynamic_ncols=interactive)
        self.log_every = config.log_every_seconds
        self.start = self.last_log = time.perf_counter()
        self.total, self.done = total, done
        self.prompt_tokens = self.output_tokens = self.errors = 0

    def add_rows(self, total: int, done: int) -> None:
        """More of a streamed input was read: `total` requests, `done` of them already finished (a resume)."""
        self.total += total
        self.done += done
        self.bar.total = self.total
        self.bar.update(done)

    def update(self, finished: list[RequestOutput], errors: int = 0) -> None:
        self.done += len(finished) + errors
        self.errors += errors + sum(o.finish_reason == "error" for o in finished)
        self.prompt_tokens += sum(o.num_prompt_tokens_run for o in finished)
        self.output_tokens += sum(len(o.token_ids) for o in finished)
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        if finished or errors:
            self.bar.set_postfix(prompt_tok_s=f"{self.prompt_tokens / elapsed:.0f}",
                                 output_tok_s=f"{self.output_tokens / elapsed:.0f}", refresh=False)
            self.bar.update(len(finished) + errors)
        if now - self.last_log >= self.log_every:
            self.last_log = now
            log.info("%d/%d requests done (%d errors), %.0f prompt tok/s, %.0f output tok/s", self.done, self.total,
                     self.errors, self.prompt_tokens / elapsed, self.output_tokens / elapsed)

    def close(self) -> None:
        self.bar.close()
