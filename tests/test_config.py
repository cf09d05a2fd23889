import pytest

from ddppipe.settings import config
from tests.tiny import default_config


def test_default_config_is_valid_and_resolves_the_fast_preset() -> None:
    cfg = config.resolve(default_config(), gpus=False)
    assert cfg["train"]["preset"] == "fast"
    assert all(cfg["train"][k] is not None for k in config.presets.RECIPE_KEYS)
    assert cfg["launch"]["nproc_per_node"] == 2


def test_reference_preset_batch_is_64_per_rank() -> None:
    cfg = default_config()
    cfg["train"]["preset"] = "reference"
    cfg["launch"]["nproc_per_node"] = 4
    resolved = config.resolve(cfg, gpus=False)["train"]
    assert (resolved["batch_size"], resolved["optimizer"], resolved["epochs"]) == (
        256,
        "adadelta",
        14,
    )


def test_explicit_keys_override_the_preset() -> None:
    cfg = default_config()
    cfg["train"].update(epochs=7, lr=0.5)
    resolved = config.resolve(cfg, gpus=False)["train"]
    assert (resolved["epochs"], resolved["lr"]) == (7, 0.5)


def test_unknown_key_and_wrong_type_are_clear_errors() -> None:
    cfg = default_config()
    cfg["train"]["epoch"] = 3
    cfg["launch"]["nproc_per_node"] = "two"
    with pytest.raises(config.ConfigError) as e:
        config.validate(cfg)
    text = str(e.value)
    assert "train: Additional properties are not allowed ('epoch' was unexpected)" in text
    assert "launch.nproc_per_node: 'two' is not of type 'integer'" in text


def test_batch_must_divide_by_world_size() -> None:
    cfg = default_config()
    cfg["train"]["batch_size"] = 129
    with pytest.raises(config.ConfigError, match="divisible by the world size 2"):
        config.resolve(cfg, gpus=False)


def test_hash_ignores_process_count_but_not_the_recipe() -> None:
    base = config.resolve(default_config(), gpus=False)
    more = default_config()
    more["launch"]["nproc_per_node"] = 4
    data = "0123456789abcdef"  # the data manifest's digest
    assert config.train_hash(config.resolve(more, gpus=False), data) == config.train_hash(
        base, data
    )
    other = default_config()
    other["train"]["seed"] = 1
    assert config.train_hash(config.resolve(other, gpus=False), data) != config.train_hash(
        base, data
    )
    assert config.train_hash(base, "fedcba9876543210") != config.train_hash(base, data)


def test_checkpoint_minutes_is_off_by_default_checked_and_not_hashed() -> None:
    """Checkpoints by time change no number: a run resumes whatever its interval."""
    base = config.resolve(default_config(), gpus=False)
    assert base["train"]["checkpoint_minutes"] is None
    timed = default_config()
    timed["train"]["checkpoint_minutes"] = 7.5
    resolved = config.resolve(timed, gpus=False)
    assert resolved["train"]["checkpoint_minutes"] == 7.5
    data = "0123456789abcdef"
    assert config.train_hash(resolved, data) == config.train_hash(base, data)
    for bad, says in ((0, "0 is less than or equal to the minimum of 0"),
                      ("30m", "'30m' is not of type 'number', 'null'")):  # fmt: skip
        wrong = default_config()
        wrong["train"]["checkpoint_minutes"] = bad
        with pytest.raises(config.ConfigError) as e:
            config.validate(wrong)
        assert f"train.checkpoint_minutes: {says}" in str(e.value)


def test_old_data_section_says_where_it_moved() -> None:
    cfg = default_config()  # (data: is data.pack's section now: told by the keys it held)
    cfg["data"] = {"mirrors": ["https://example.org/mnist/"], "timeout_s": 10}
    with pytest.raises(config.ConfigError, match=r"are now task_args of the task ddppipe\."):
        config.validate(cfg)
