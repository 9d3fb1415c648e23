"""A Ray dataset's output batches, iterated on a helper thread so that a stop signal never lands inside Ray.

Signal handlers run in the main thread, between any two bytecodes. Raised inside Ray's code (starting an execution,
waiting for its first output), a StopRequested can leave the execution running with nothing left to shut it down:
its actors keep their CPUs or GPUs, and a resume in the same process waits for them forever. Here Ray runs on a
helper thread, the main thread only waits on a queue, and a stop shuts the execution down from outside.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import ray.data

_END = object()


@dataclass
class _Failed:
    error: BaseException


def iter_batches(dataset: ray.data.Dataset) -> Iterator[dict[str, Any]]:
    """The dataset's batches (numpy, as Ray returns them); closing the iterator, or an exception in the consumer
    (a stop signal included), ends the execution and waits until it has released its actors."""
    batches: queue.Queue = queue.Queue()
    stop = threading.Event()
    helper = threading.Thread(target=_produce, args=(dataset, batches, stop), name="batchgen-ray-batches",
                              daemon=True)
    helper.start()
    try:
        while (item := batches.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while helper.is_alive():
            # The execution may not have started yet when the stop came: retry until the helper sees it end.
            _shut_down_execution(dataset)
            helper.join(timeout=0.05)


def _produce(dataset: ray.data.Dataset, batches: queue.Queue, stop: threading.Event) -> None:
    try:
        with closing(iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))) as produced:
            for batch in produced:
                if stop.is_set():
                    break
                batches.put(batch)
    except BaseException as error:  # handed to the consumer, which raises it
        batches.put(_Failed(error))
    finally:
        batches.put(_END)


def _shut_down_execution(dataset: ray.data.Dataset) -> None:
    """Shuts down the dataset's running execution (its operators, actors included); the consumer waiting for its
    next output then sees the end of the stream. Ray names the execution's thread after it; a shutdown of an
    execution that is already shut down, or not yet started, does nothing. Where a Ray version names neither, a stop
    waits for the execution's next output instead (the helper then stops iterating, which shuts it down)."""
    dataset_id = getattr(dataset, "get_dataset_id", None)
    if dataset_id is None:
        return
    name = f"StreamingExecutor-{dataset_id()}"
    for thread in threading.enumerate():
        if thread.name == name and callable(getattr(thread, "shutdown", None)):
            thread.shutdown(force=True)
