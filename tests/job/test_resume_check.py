"""Resume refuses a configuration that would change outputs, names every differing key, and allows the rest."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from batchgen.config import Config, ConfigError
from batchgen.job.resume_check import RUN_CONFIG_FILE, alters_outputs, check_resume, output_differences


def config_dict(**changes: dict) -> dict:
    values = json.loads(json.dumps(asdict(Config())))  # as config.json stores it
    for group, keys in changes.items():
        values[group].update(keys)
    return values


def test_output_altering_keys_differ_and_throughput_knobs_do_not():
    started = config_dict()
    current = config_dict(sampling={"max_tokens": 32}, engine={"seed": 5, "max_num_seqs": 8, "enforce_eager": True,
                                                              "cuda_graph": {"capture_sizes": [1, 2]}},
                          job={"flush_rows": 1, "resume": True}, model={"dtype": "bfloat16"})
    assert output_differences(started, current) == {
        "engine.seed": (0, 5), "model.dtype": ("auto", "bfloat16"), "sampling.max_tokens": (started["sampling"]
                                                                                            ["max_tokens"], 32)}


def test_a_run_started_before_model_impl_existed_resumes():
    started = config_dict()
    del started["model"]["impl"]
    assert output_differences(started, config_dict()) == {}
    assert output_differences(config_dict(), config_dict(model={"impl": "transformers"})) == {}


def test_a_key_the_list_does_not_know_alters_outputs():
    assert alters_outputs("engine.some_future_knob") and alters_outputs("data.limit")
    assert not alters_outputs("engine.cuda_graph.max_capture_size")
    assert not alters_outputs("engine.parallel_compile")  # where the same kernels compile
    started, current = config_dict(), config_dict(engine={"some_future_knob": 1})
    assert output_differences(started, current) == {"engine.some_future_knob": (None, 1)}


def test_first_start_records_the_config_and_a_resume_compares_with_it(tmp_path):
    assert check_resume(tmp_path, config_dict(), False) is None
    assert json.loads((tmp_path / RUN_CONFIG_FILE).read_text())["config"] == config_dict()
    assert check_resume(tmp_path, config_dict(engine={"max_num_seqs": 3}), True) is None
    changed = config_dict(sampling={"max_tokens": 32}, engine={"seed": 5})
    with pytest.raises(ConfigError, match="engine.seed: 0 -> 5.*sampling.max_tokens") as refused:
        check_resume(tmp_path, changed, True)
    assert "job.resume=force" in str(refused.value)
    forced = check_resume(tmp_path, changed, "force")
    assert set(forced["differences"]) == {"engine.seed", "sampling.max_tokens"}
    assert forced["started_config"] == config_dict()
    assert json.loads((tmp_path / RUN_CONFIG_FILE).read_text())["config"] == config_dict()  # the started one stays
