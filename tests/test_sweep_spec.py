"""The sweep: section (ddppipe.settings.sweep): trial names (ddppipe.settings.trial_names),
random draws, a trial's config, rounds and the errors of bad input. Quick: no workflow, no
training."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from ddppipe.runstate import sweep_rounds
from ddppipe.settings import sweep as sweeps
from ddppipe.settings import trial_names
from ddppipe.settings.config import ConfigError, validate
from ddppipe.settings.runs import Runs
from tests.tiny import REPO, default_config

BASE = validate(default_config())


def config(**section: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    cfg["sweep"] = section
    return validate(cfg)


def parse(**section: Any) -> sweeps.Sweep:
    found = sweeps.from_config(config(**section))
    assert found is not None
    return found


def names(**section: Any) -> list[str]:
    return [t.name for t in sweeps.trials(parse(**section))]


def test_a_grid_is_every_combination_named_after_its_values() -> None:
    assert names(name="s", parameters={"train.lr": [0.01, 0.1], "train.batch_size": [64, 256]}) == [
        "lr=0.01+batch_size=64", "lr=0.01+batch_size=256",
        "lr=0.1+batch_size=64", "lr=0.1+batch_size=256",
    ]  # fmt: skip


def test_values_of_every_type_make_readable_names() -> None:
    found = names(name="s", parameters={
        "train.precision": ["bf16"], "train.channels_last": [True], "train.lr": [1.0, 1e-4],
        "task_args.layers": [[64, 32]],
    })  # fmt: skip
    assert found == [
        "precision=bf16+channels_last=true+lr=1.0+layers=64_32",
        "precision=bf16+channels_last=true+lr=0.0001+layers=64_32",
    ]


def test_keys_sharing_their_last_part_are_labelled_by_their_whole_path() -> None:
    assert names(name="s", parameters={"train.seed": [1], "task_args.seed": [2]}) == [
        "train.seed=1+task_args.seed=2"
    ]


def test_values_that_differ_only_in_characters_get_a_hash() -> None:
    found = names(name="s", parameters={"task_args.opt": ["a b", "a/b"]})
    assert len(set(found)) == 2
    assert all(n.startswith("opt=a_b-") and len(n) == len("opt=a_b-") + 8 for n in found)


def test_a_long_name_is_shortened_with_a_hash() -> None:
    (name,) = names(name="s", parameters={"task_args.text": ["x" * 300]})
    assert len(name) == trial_names.MAX_NAME and name.startswith("text=xxx")


def test_names_survive_the_slurm_plugins_wildcards_and_a_shell() -> None:
    """The plugin hands a job's wildcards to the job's own Snakemake as ``rule:name=value,...``
    (its encoder, Snakemake's parser); the name is also a path and a word of a shell."""
    import shlex

    from snakemake.target_jobs import parse_target_jobs_cli_args
    from snakemake_interface_executor_plugins.utils import TargetSpec, encode_target_jobs_cli_args

    found = sweeps.trials(parse(name="s", parameters={
        "train.lr": [1e-5], "train.batch_size": [64], "task_args.arch": ["a,b c;d"],
        "task_args.layers": [[64, 32]],
    }))  # fmt: skip
    (trial,) = found
    assert trial.name == "lr=1e-05+batch_size=64+arch=a_b_c_d+layers=64_32", trial.name
    encoded = encode_target_jobs_cli_args([TargetSpec("train", {"run": trial.run})])
    assert parse_target_jobs_cli_args(encoded)[0].wildcards_dict == {"run": trial.run}
    assert shlex.quote(trial.run) == trial.run
    assert validate({**copy.deepcopy(BASE), "run": trial.run})["run"] == trial.run


def test_a_run_name_with_a_comma_is_refused() -> None:
    with pytest.raises(ConfigError, match="run: 'a,b' does not match"):
        validate({**copy.deepcopy(BASE), "run": "a,b"})


def test_names_recorded_before_read_as_todays() -> None:
    assert trial_names.current_name("lr=0.01,batch_size=256") == "lr=0.01+batch_size=256"
    assert trial_names.current_name("lr=0.01") == "lr=0.01"


def test_random_draws_are_seeded_and_more_trials_keep_the_first_ones() -> None:
    space = {"train.lr": {"low": 0.001, "high": 0.1, "log": True},
             "train.batch_size": {"choices": [64, 128, 256]}}  # fmt: skip
    first = names(name="r", method="random", trials=4, seed=7, parameters=space)
    assert first == names(name="r", method="random", trials=4, seed=7, parameters=space)
    assert names(name="r", method="random", trials=6, seed=7, parameters=space)[:4] == first
    assert names(name="r", method="random", trials=4, seed=8, parameters=space) != first
    trials = sweeps.trials(parse(name="r", method="random", trials=4, seed=7, parameters=space))
    for t in trials:
        assert 0.001 <= t.values["train.lr"] <= 0.1
        assert t.values["train.batch_size"] in (64, 128, 256)
        assert len(str(t.values["train.lr"]).replace("0.", "").lstrip("0")) <= 4  # 4 digits


def test_an_integer_range_draws_integers_and_a_small_space_its_distinct_points() -> None:
    found = sweeps.trials(parse(name="r", method="random", trials=10, parameters={
        "launch.nproc_per_node": {"low": 1, "high": 2}}))  # fmt: skip
    assert sorted(t.values["launch.nproc_per_node"] for t in found) == [1, 2]


def test_a_trials_config_is_the_base_with_its_values_named_after_it() -> None:
    cfg = config(name="s", parameters={"train.lr": [0.5], "task_args.width": [8]}, prune="median")
    found = sweeps.from_config(cfg)
    assert found is not None
    (trial,) = sweeps.trials(found)
    out = sweeps.apply(cfg, found, trial)
    assert out["run"] == "sweeps/s/lr=0.5+width=8"
    assert out["train"]["lr"] == 0.5 and out["task_args"] == {"width": 8}
    assert out["train"]["epochs"] == cfg["train"]["epochs"]
    assert "sweep" not in out and "sweep" in cfg  # the base config is left as it was
    assert out["trial"] == {
        "sweep": "s", "name": "lr=0.5+width=8", "values": {"train.lr": 0.5, "task_args.width": 8},
        "prune": {"method": "median", "metric": "accuracy", "direction": "maximize",
                  "warmup_epochs": 1},
    }  # fmt: skip
    validate(out)  # a trial's config is a valid config


def test_runs_knows_every_trial_and_refuses_an_unknown_run() -> None:
    runs = Runs(config(name="s", parameters={"train.lr": [0.01, 0.1]}))
    assert runs.names()[0] == "mnist"
    assert runs.names()[-2:] == ["sweeps/s/lr=0.01", "sweeps/s/lr=0.1"]
    assert runs.config("sweeps/s/lr=0.1")["train"]["lr"] == 0.1
    assert "sweep" not in runs.config("mnist")
    with pytest.raises(ConfigError, match=r"unknown run 'sweeps/s/lr=0.2': this config defines"):
        runs.config("sweeps/s/lr=0.2")


def test_tpe_rounds_and_the_trials_their_files_name(tmp_path: Path) -> None:
    found = parse(name="t", method="tpe", trials=5, max_parallel=2,
                  parameters={"train.lr": {"low": 0.01, "high": 0.1}})  # fmt: skip
    # 2 at once, then one a round: round k once k trials have ended (a slot free for it)
    assert sweep_rounds.round_sizes(found, tmp_path) == [2, 1, 1, 1]
    assert [sweep_rounds.ended_before(found, k, tmp_path) for k in range(4)] == [0, 1, 2, 3]
    assert sweep_rounds.trials(found, rounds=tmp_path) == []
    trial = {"name": "lr=0.05", "values": {"train.lr": 0.05}, "number": 0}
    (tmp_path / "0.json").write_text(json.dumps({"round": 0, "trials": [trial]}))
    (tmp_path / "2.json").write_text(json.dumps({"round": 2, "trials": [trial]}))  # no round 1
    assert [t.name for t in sweep_rounds.trials(found, rounds=tmp_path)] == ["lr=0.05"]
    assert sweep_rounds.trials(found, upto=0, rounds=tmp_path) == []


def test_a_tpe_sweep_suggested_in_whole_rounds_before_keeps_them(tmp_path: Path) -> None:
    """Its round 1 holds 2 trials: rounds of max_parallel, each after all trials before it."""
    found = parse(name="t", method="tpe", trials=5, max_parallel=2,
                  parameters={"train.lr": {"low": 0.01, "high": 0.1}})  # fmt: skip
    trials = [{"name": f"lr=0.0{k}", "values": {"train.lr": k / 100}, "number": k}
              for k in range(1, 5)]  # fmt: skip
    (tmp_path / "0.json").write_text(json.dumps({"round": 0, "trials": trials[:2]}))
    (tmp_path / "1.json").write_text(json.dumps({"round": 1, "trials": trials[2:]}))
    assert sweep_rounds.round_sizes(found, tmp_path) == [2, 2, 1]
    assert sweep_rounds.ended_before(found, 2, tmp_path) == 4  # every trial before it
    assert len(sweep_rounds.trials(found, rounds=tmp_path)) == 4


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"parameters": {"train.learning_rate": [0.1]}},
         "sweep.parameters.train.learning_rate: not a config key; a parameter is a key by its "
         "dotted path"),
        ({"parameters": {"train": [{}]}}, "sweep.parameters.train: not a config key"),
        ({"parameters": {"task": ["x"]}},
         "sweep.parameters.task: task cannot vary across trials: a sweep trains one task"),
        ({"parameters": {"train.batch_size": [64, 0]}},
         "sweep.parameters.train.batch_size[1]: 0 is not a valid train.batch_size"),
        ({"parameters": {"train.lr": []}},
         "sweep.parameters.train.lr: an empty list gives 0 trials; list at least one value"),
        ({"parameters": {"train.lr": [0.1, 0.1]}}, "lists a value twice"),
        ({"parameters": {}}, "sweep s: sweep.parameters is empty, a sweep of 0 trials"),
        ({"parameters": {"train.lr": {"low": 0.1, "high": 0.01}}},
         "sweep.parameters.train.lr: a range ({low, high}) needs method random or tpe"),
        ({"method": "random", "parameters": {"train.lr": {"low": 0.1, "high": 0.01}}},
         "{low: 0.1, high: 0.01, log: False} is not a range"),
        ({"method": "random", "parameters": {"train.lr": {"low": 0, "high": 1, "log": True}}},
         "and low > 0 with log: true"),
        ({"parameters": {"train.lr": {"choices": [0.1]}}},
         "choices are for method random or tpe; a grid lists values"),
    ],
    ids=["not-a-key", "a-section", "fixed", "schema-rejects", "empty-list", "twice",
         "no-parameters", "range-in-grid", "low-above-high", "log-of-zero", "choices-in-grid"],
)  # fmt: skip
def test_bad_input_is_named(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(name="s", **section)
    assert message in str(e.value)


def test_the_metric_must_be_one_the_tasks_evaluation_writes(tmp_path: Path) -> None:
    digits = REPO / "src/ddppipe/tasks/digits.py"
    sweeps.check_metric(parse(name="s", parameters={"train.lr": [0.1]}, metric="loss"), digits)
    with pytest.raises(ConfigError, match=r"'f1' is not a metric .* it writes accuracy, loss"):
        sweeps.check_metric(parse(name="s", parameters={"train.lr": [0.1]}, metric="f1"), digits)
    tinycnn = REPO / "examples/tasks/tinycnn.py"  # its metrics() returns top2_accuracy too
    top2 = parse(name="s", parameters={"train.lr": [0.1]}, metric="top2_accuracy")
    sweeps.check_metric(top2, tinycnn)
    with pytest.raises(ConfigError, match="it writes accuracy, loss, top2_accuracy"):
        sweeps.check_metric(parse(name="s", parameters={"train.lr": [0.1]}, metric="f1"), tinycnn)
    sweeps.check_metric(top2, None)  # a script: what it logs is known once it ran


def test_a_sweep_name_used_by_another_sweep_is_refused(tmp_path: Path) -> None:
    first = parse(name="s", parameters={"train.lr": [0.1]})
    recorded = tmp_path / "sweep.json"
    recorded.write_text(json.dumps({"definition": first.definition()}))
    sweeps.check_definition(parse(name="s", parameters={"train.lr": [0.1, 0.2]}), recorded)
    with pytest.raises(ConfigError) as e:
        sweeps.check_definition(parse(name="s", parameters={"train.seed": [1]}), recorded)
    assert f"sweep s: {recorded} records another sweep of this name" in str(e.value)
    assert '"keys": ["train.lr"]' in str(e.value) and '"keys": ["train.seed"]' in str(e.value)


# -- a model-based sweep's rounds (ddppipe.sweeps.rounds) --------------------------------


def ended(results: Path, trial: dict[str, Any]) -> Path:
    """What a trial's finished training leaves: its attempt history; its run folder."""
    run = results / "sweeps" / "t" / trial["name"]
    (run / "train").mkdir(parents=True, exist_ok=True)
    (run / "train/attempts.json").write_text("[]")
    return run


def evaluate(results: Path, trial: dict[str, Any], accuracy: float) -> None:
    """What a finished trial's training and evaluation leave: its eval/metrics.json."""
    path = ended(results, trial) / "eval" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"test_accuracy": accuracy, "test_loss": 1 - accuracy}))


def test_rounds_tell_the_finished_trials_once_and_ask_again_the_same(tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from ddppipe.sweeps import rounds

    found = parse(name="t", method="tpe", trials=3, max_parallel=2, seed=1,
                  parameters={"train.lr": {"low": 0.01, "high": 0.1},
                              "task_args.width": {"choices": [8, 16]}})  # fmt: skip
    folder, journal = tmp_path / "rounds", tmp_path / "optuna.journal"

    def write(k: int) -> dict[str, Any]:
        return rounds.write_round(found, k, folder / f"{k}.json", tmp_path, journal)

    first = write(0)["trials"]
    assert [t["number"] for t in first] == [0, 1] and first[0]["name"] != first[1]["name"]
    assert write(0)["trials"] == first  # asked again (a re-run checkpoint): the same trials
    with pytest.raises(ConfigError, match="no round 2; 3 trials, 2 at once, make rounds 0-1"):
        write(2)
    evaluate(tmp_path, first[0], 0.75)
    evaluate(tmp_path, first[1], 0.5)
    study = rounds.open_study(found, journal)
    study.tell(1, 0.25)  # the training's pruning told trial 1 first: not told again
    (second,) = write(1)["trials"]
    assert second["name"] not in {t["name"] for t in first}
    told = {t.number: (t.state, t.value) for t in rounds.open_study(found, journal).get_trials()}
    assert told[0] == (TrialState.COMPLETE, 0.75)
    assert told[1] == (TrialState.COMPLETE, 0.25)
    assert told[second["number"]][0] == TrialState.RUNNING
    assert [t.name for t in sweep_rounds.trials(found, rounds=folder)] == [
        first[0]["name"],
        first[1]["name"],
        second["name"],
    ]
    assert json.loads((folder / "1.json").read_text())["trials"] == [second]


def test_a_slot_that_frees_gets_a_trial_while_the_other_trains(tmp_path: Path) -> None:
    """Round 1 once trial 0's training ended (its final evaluation): trial 1, still training,
    is not told (the sampler takes it for the worst), and the new trial differs from both."""
    from optuna.trial import TrialState

    from ddppipe.sweeps import rounds

    found = parse(name="t", method="tpe", trials=3, max_parallel=2, seed=3,
                  parameters={"train.lr": {"low": 0.01, "high": 0.1}})  # fmt: skip
    folder, journal = tmp_path / "rounds", tmp_path / "optuna.journal"
    first = rounds.write_round(found, 0, folder / "0.json", tmp_path, journal)["trials"]
    evaluation = ended(tmp_path, first[0]) / "train/evaluation.json"
    evaluation.write_text(json.dumps({"test_accuracy": 0.6, "test_loss": 0.4}))
    (third,) = rounds.write_round(found, 1, folder / "1.json", tmp_path, journal)["trials"]
    states = {t.number: t.state for t in rounds.open_study(found, journal).get_trials()}
    assert states == {0: TrialState.COMPLETE, 1: TrialState.RUNNING,
                      third["number"]: TrialState.RUNNING}  # fmt: skip
    assert third["name"] not in {t["name"] for t in first}


def test_a_round_names_a_metric_the_evaluation_lacks(tmp_path: Path) -> None:
    from ddppipe.sweeps import rounds

    found = parse(name="t", method="tpe", trials=2, max_parallel=1, metric="f1",
                  parameters={"train.lr": {"low": 0.01, "high": 0.1}})  # fmt: skip
    folder, journal = tmp_path / "rounds", tmp_path / "optuna.journal"
    (trial,) = rounds.write_round(found, 0, folder / "0.json", tmp_path, journal)["trials"]
    evaluate(tmp_path, trial, 0.75)
    with pytest.raises(
        ConfigError, match=r"sweep.metric 'f1' is not in .* its metrics: accuracy, loss"
    ):
        rounds.write_round(found, 1, folder / "1.json", tmp_path, journal)


COUNTING_TASK = '''
"""A user's task that counts how often its model is built."""
from pathlib import Path

import torch

COUNT = Path(__file__).with_name("models_built")


def prepare(data_dir, args):
    pass


def datasets(data_dir, args):
    raise NotImplementedError


def model(args):
    COUNT.write_text(str(int(COUNT.read_text()) + 1 if COUNT.exists() else 1))
    return torch.nn.Linear(2, args.get("width", 2))
'''


def test_trials_sharing_task_args_check_the_task_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_config keeps a passed check of task_args and model(): the trials of an lr sweep
    build the model once; other task_args, or an edited task file, are checked again."""
    from ddppipe.launching import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "counting.py").write_text(COUNTING_TASK)
    cfg = copy.deepcopy(BASE)
    cfg.update(task="counting.py", task_args={"width": 3})
    for lr in (0.01, 0.1, 0.01):
        cfg["train"]["lr"] = lr
        resolve.write_resolved(cfg, tmp_path / f"lr{lr}.yaml", gpus=False)
    assert (tmp_path / "models_built").read_text() == "1"
    assert (tmp_path / "lr0.01.yaml").read_text().count("width: 3") == 1
    cfg["task_args"] = {"width": 4}
    resolve.write_resolved(cfg, tmp_path / "w4.yaml", gpus=False)
    assert (tmp_path / "models_built").read_text() == "2"
    (tmp_path / "counting.py").write_text(COUNTING_TASK + "\n# edited\n")
    resolve.write_resolved(cfg, tmp_path / "w4.yaml", gpus=False)
    assert (tmp_path / "models_built").read_text() == "3"
