"""One config struct from flags, then STREAMBATCH_* variables, then defaults; the engine flags
are the engine's own option names."""

import pytest

from worker.config import ENGINE_OPTIONS, WorkerConfig, flag, parse_config
from worker.engine.config import EngineConfig


def test_flags_win_over_variables_which_win_over_defaults():
    config = parse_config(
        ["--model", "random:llama", "--token-budget", "64", "--no-enable-prefix-caching", "--metrics-port", "0"],
        {"STREAMBATCH_TOKEN_BUDGET": "999", "STREAMBATCH_NUM_BLOCKS": "128", "STREAMBATCH_DRAIN_TIMEOUT": "2.5",
         "STREAMBATCH_REDIS_URL": "redis://elsewhere:6380/1", "STREAMBATCH_POLICY": "static"})
    assert config.engine == EngineConfig.from_options("random:llama", token_budget=64, num_blocks=128,
                                                      enable_prefix_caching=False, policy="static")
    assert (config.metrics_port, config.drain_timeout, config.redis_url) == (0, 2.5, "redis://elsewhere:6380/1")
    assert config.prefix == "sb" and config.max_deliveries == 3 and config.name


def test_the_model_can_come_from_the_environment():
    assert parse_config([], {"STREAMBATCH_MODEL": "random:qwen2"}).engine.model == "random:qwen2"
    assert parse_config([], {}).engine.model == "smollm2-135m"  # the bundled model


def test_every_engine_option_is_a_flag_of_the_same_name():
    for name, field in ENGINE_OPTIONS.items():
        if field.default is not None and field.type is not bool:
            config = parse_config([flag(name), str(field.default)], {})
            assert config.engine == EngineConfig.from_options("smollm2-135m", **{name: field.default}), name


@pytest.mark.parametrize("argv, message", [
    (["--watermark", "2"], "watermark must be in [0, 1)"),
    (["--policy", "sometimes"], "--policy: Invalid enum value 'sometimes'"),
    (["--metrics-port", "eighty"], "metrics_port"),
    (["--heartbeat-interval", "5", "--reclaim-idle-ms", "1000"], "at least 3 heartbeat intervals"),
    (["--metrics-port", "99999"], "metrics_port must be in [0, 65535], got 99999"),
    (["--block-size", "0"], "block_size must be >= 1, got 0"),
])
def test_a_bad_value_exits_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv, {})
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_derived_timings():
    config = WorkerConfig(heartbeat_interval=0.4, reclaim_idle_ms=1500)
    assert config.heartbeat_ttl_ms == 3400 and config.block_ms == 200
    assert WorkerConfig().block_ms == 1000
