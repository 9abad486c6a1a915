"""`steps.serve`'s command line as a config (`pipeline.config.ServeConfig`, `validate_serve`), in process: every flag
the docs write parses, each refusal names its field, and the bearer token never reaches the log."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import draccus
import pytest

from pipeline.config import ConfigError, ServeConfig, validate_serve
from steps.cli import parse_config, redacted


def test_the_documented_flags_parse_into_the_config() -> None:
    argv = ["--run_root", "runs/demo", "--policy_step", "0", "--port", "0", "--announce_file", "/tmp/serve.json",
            "--reuse_port", "true", "--max_seqs", "4", "--wait_s", "0.3", "--token_env", "MY_TOKEN"]  # fmt: skip
    config = parse_config(ServeConfig, argv)
    assert config == ServeConfig(run_root="runs/demo", policy_step=0, port=0, announce_file="/tmp/serve.json",
                                 reuse_port=True, max_seqs=4, wait_s=0.3, token_env="MY_TOKEN")  # fmt: skip
    validate_serve(config)


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"run_root": ""}, "run_root='': is required"),
        ({"policy_step": -1}, "policy_step=-1: must be >= 0"),
        ({"port": 65536}, "port=65536: must be in [0, 65535]"),
        ({"max_seqs": 0}, "max_seqs=0: must be >= 1"),
        ({"host": "0.0.0.0"}, "host='0.0.0.0': is not loopback: give --token or set RLPIPE_SERVE_TEST_TOKEN"),
    ],
)
def test_each_refusal_names_its_field(fields: dict[str, Any], line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPIPE_SERVE_TEST_TOKEN", raising=False)
    config = dataclasses.replace(ServeConfig(run_root="r", token_env="RLPIPE_SERVE_TEST_TOKEN"), **fields)
    with pytest.raises(ConfigError) as refused:
        validate_serve(config)
    assert str(refused.value).startswith(line), str(refused.value)


def test_a_public_host_takes_its_token_from_the_flag_or_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLPIPE_SERVE_TEST_TOKEN", raising=False)
    public = ServeConfig(run_root="r", host="0.0.0.0", token_env="RLPIPE_SERVE_TEST_TOKEN")
    assert public.bearer_token() is None
    validate_serve(ServeConfig(run_root="r", host="0.0.0.0", token="given"))
    monkeypatch.setenv("RLPIPE_SERVE_TEST_TOKEN", "from-env")
    assert public.bearer_token() == "from-env"
    validate_serve(public)


def test_the_logged_config_never_holds_the_token(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded = redacted(draccus.encode(ServeConfig(run_root="r", token="s3cret")))
    assert isinstance(encoded, dict) and encoded["token"] == "<redacted>" and encoded["run_root"] == "r"
    assert redacted({"a": [{"token": "x"}], "token": None}) == {"a": [{"token": "<redacted>"}], "token": None}
    # the line run_program logs as it parses serve's command line (serving itself is not what is tested here)
    from steps import serve

    served: list[ServeConfig] = []

    def record(config: ServeConfig) -> int:
        served.append(config)
        return 0

    monkeypatch.setattr(serve, "main", record)
    with caplog.at_level(logging.INFO, logger="rlpipe.cli"):
        rc = serve.cli(["--run_root", "/nonexistent/run", "--token", "s3cret"])
    assert rc == 0 and served[0].bearer_token() == "s3cret"
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: ")]
    assert logged and "s3cret" not in logged[0], logged
    assert json.loads(logged[0].removeprefix("config: "))["token"] == "<redacted>"
