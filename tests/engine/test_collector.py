"""The engine loops run Python's garbage collector rarely, and give the caller's thresholds back after."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from batchgen.config import Config, DataConfig, EngineConfig, JobConfig, ModelConfig
from batchgen.engine.collector import LOOP_THRESHOLDS, rare_collections
from batchgen.engine.llm_engine import LLMEngine
from batchgen.job.run import run
from batchgen.llm import LLM
from batchgen.sample.params import SamplingParams

SHAKESPEARE_MODEL = Path(__file__).resolve().parents[2] / "jobs" / "shakespeare" / "model"


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_rare_collections_restore_the_thresholds_after_an_error(default_thresholds: None) -> None:
    with pytest.raises(RuntimeError), rare_collections():
        assert gc.get_threshold() == LOOP_THRESHOLDS
        raise RuntimeError("a step failed")
    assert gc.get_threshold() == (700, 10, 10)


class CountingEngine:
    """Three steps, each recording the collector's thresholds it ran under."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    @property
    def has_unfinished_requests(self) -> bool:
        return len(self.seen) < 3

    def step(self) -> tuple[list, None]:
        self.seen.append(gc.get_threshold())
        return [], None


def test_llm_steps_run_with_rare_collections(default_thresholds: None) -> None:
    llm = LLM.__new__(LLM)  # the loop alone: no model
    llm.engine = CountingEngine()
    assert llm._run(total=0, desc="", use_tqdm=False) == []
    assert llm.engine.seen == [LOOP_THRESHOLDS] * 3
    assert gc.get_threshold() == (700, 10, 10)


def test_collections_counts_and_times_the_passes_in_its_block(default_thresholds: None) -> None:
    with rare_collections() as collections:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after the block: not counted
    assert collections.count == 2 and collections.seconds > 0


def test_job_steps_run_with_rare_collections_and_the_summary_counts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_thresholds: None) -> None:
    seen: list[tuple[int, int, int]] = []
    step = LLMEngine.step

    def recording_step(engine: LLMEngine):
        seen.append(gc.get_threshold())
        gc.collect(0)  # one young collection a step, as the default thresholds would run many
        return step(engine)

    monkeypatch.setattr(LLMEngine, "step", recording_step)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ROMEO:"}\n{"prompt": "KING"}\n')
    config = Config(job=JobConfig(progress=False), model=ModelConfig(path=str(SHAKESPEARE_MODEL)),
                    engine=EngineConfig(device="cpu", max_num_seqs=2), data=DataConfig(path=str(prompts)),
                    sampling=SamplingParams(temperature=0, max_tokens=4))
    summary = run(config, tmp_path / "run")
    assert summary["rows"] == 2
    assert seen and set(seen) == {LOOP_THRESHOLDS}
    collections = summary["this_attempt"]["engine_loop_collections"]
    assert collections["count"] >= len(seen) and 0 < collections["seconds"] < summary["wall_seconds"]
    assert gc.get_threshold() == (700, 10, 10)
