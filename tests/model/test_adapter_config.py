"""adapter_config.json's fields, checked by name before anything loads (model/lora/config.py):
wrong types and non-finite scales are ValueErrors naming the field, never a TypeError (the API's
500) or a NaN scale that mounts; a directory that cannot be read gets one message whether or not
it exists."""

from __future__ import annotations

import json
import math

import pytest

from model.lora.config import config_problem, read_adapter_config

GOOD = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}


def with_params(**params: object) -> dict:
    return {**GOOD, "lora_parameters": {**GOOD["lora_parameters"], **params}}


def test_a_good_config_passes():
    assert config_problem(GOOD) is None
    assert config_problem(with_params(keys=["self_attn.q_proj", "lm_head"], scale=20)) is None
    assert config_problem({"lora_parameters": {"rank": 1, "scale": -0.5}}) is None  # type and layers default


@pytest.mark.parametrize(
    ("config", "field", "shown"),
    [
        (with_params(keys=[[1]]), '"lora_parameters.keys"', "[[1]]"),
        (with_params(keys="q_proj"), '"lora_parameters.keys"', '"q_proj"'),
        ({**GOOD, "num_layers": [1]}, '"num_layers"', "[1]"),
        ({**GOOD, "num_layers": 1.5}, '"num_layers"', "1.5"),
        ({**GOOD, "num_layers": True}, '"num_layers"', "true"),
        (with_params(scale=[1, 2]), '"lora_parameters.scale"', "[1, 2]"),
        (with_params(scale=math.nan), '"lora_parameters.scale"', "NaN"),
        (with_params(scale=math.inf), '"lora_parameters.scale"', "Infinity"),
        (with_params(scale="2"), '"lora_parameters.scale"', '"2"'),
        (with_params(scale=None), '"lora_parameters.scale"', "null"),
        (with_params(rank=0), '"lora_parameters.rank"', "0"),
        (with_params(rank=4.0), '"lora_parameters.rank"', "4.0"),
        (with_params(rank={"r": 4}), '"lora_parameters.rank"', '{"r": 4}'),
        ({**GOOD, "fine_tune_type": ["lora"]}, '"fine_tune_type"', '["lora"]'),
        ({**GOOD, "fine_tune_type": "ia3"}, '"fine_tune_type"', '"ia3"'),
    ],
)
def test_a_wrong_field_is_named_with_its_value(config, field, shown):
    problem = config_problem(config)
    assert problem is not None and problem.startswith(field) and f"(got {shown})" in problem


def test_the_config_as_a_whole():
    assert config_problem([GOOD]) == "adapter_config.json is not a JSON object"
    assert 'needs "lora_parameters"' in (config_problem({"fine_tune_type": "dora"}) or "")
    assert "full fine-tune" in (config_problem({"fine_tune_type": "full"}) or "")
    long = config_problem(with_params(keys=[["x" * 100]])) or ""
    assert len(long) < 120 and long.endswith("...)")  # a long value is cut in the message


def test_read_parses_nan_and_huge_numbers_and_refuses_them(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"lora_parameters": {"rank": 4, "scale": NaN}}')
    with pytest.raises(
        ValueError, match=r"^adapter 'a': \"lora_parameters.scale\" must be a finite number \(got NaN\)"
    ):
        read_adapter_config(tmp_path, "a")
    (tmp_path / "adapter_config.json").write_text('{"lora_parameters": {"rank": 4, "scale": 1e400}}')
    with pytest.raises(ValueError, match=r"got Infinity"):
        read_adapter_config(tmp_path, "a")
    (tmp_path / "adapter_config.json").write_text('{"lora_parameters": {"rank": 4, "scale": 1')
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        read_adapter_config(tmp_path, "a")
    (tmp_path / "adapter_config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        read_adapter_config(tmp_path, "a")
    (tmp_path / "adapter_config.json").write_text(json.dumps(GOOD))
    assert read_adapter_config(tmp_path, "a") == GOOD


def test_an_unreadable_directory_does_not_say_whether_it_exists(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "config-is-a-dir" / "adapter_config.json").mkdir(parents=True)
    messages = set()
    for name in ("absent", "empty", "a-file", "config-is-a-dir"):
        with pytest.raises(ValueError) as refused:
            read_adapter_config(tmp_path / name, "a")
        messages.add(str(refused.value).replace(str(tmp_path / name), "PATH"))
    assert messages == {
        "adapter 'a': PATH is not a readable adapter directory (adapter_config.json + adapters.safetensors)"
    }
