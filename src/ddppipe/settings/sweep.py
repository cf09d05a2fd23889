"""A sweep: many runs of one config, each with other values of some of its keys.

The ``sweep:`` section names the sweep, the keys that vary (``parameters``: a config key by
its dotted path mapped to a list of values, a grid axis, or to a range or choices for sampled
search) and how trials are chosen (``method``). Each trial is an ordinary run named
``sweeps/<sweep>/<trial>``, its config the base config with the trial's values; the trial's
name is derived from its values (``lr=0.01+batch_size=256``:
:mod:`ddppipe.settings.trial_names`).

Grid and random trials are known when the workflow is parsed (random: Optuna's seeded
sampler, so the same sweep suggests the same trials and more ``trials`` only adds trials);
a model-based method's trials are suggested in rounds from the finished ones
(:mod:`ddppipe.sweeps.rounds`) and read back from its round files
(:mod:`ddppipe.runstate.sweep_rounds`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddppipe.settings import layout, trial_names
from ddppipe.settings.config import ConfigError, coerce, schema, validate
from ddppipe.settings.run_spec import SweepSection

SAMPLED = ("random", "tpe")  # methods that draw values from ranges and choices
# Keys a trial cannot change: what names the run, what every trial shares (the task, the
# image) and the studies themselves.
FIXED = {
    "run": "it names the run; each trial is named after its values",
    "task": "a sweep trains one task (its data rules, its checks); sweep task_args instead",
    "script": "a sweep runs one script; sweep its script_args or task_args instead",
    "container": "every trial trains in the same image",
    "sweep": "a sweep cannot sweep itself",
    "trial": "ddppipe writes it for each trial",
    "scaling": "the scaling study is a sweep of its own (`snakemake scaling`)",
}
SIGNIFICANT_DIGITS = 4  # of a sampled float: what the trial's name shows is its value
# The user attribute that names a trial's ddppipe trial in the sweep's Optuna study (journal).
OPTUNA_TRIAL_ATTR = "ddppipe_trial"


@dataclass(frozen=True)
class Parameter:
    """One key that varies: a grid axis (``values``), a range or choices (sampled methods)."""

    key: str  # the dotted config key, e.g. train.lr
    values: tuple[Any, ...] | None = None  # a grid axis (or a sampled method's choices)
    low: float | None = None
    high: float | None = None
    log: bool = False

    @property
    def is_range(self) -> bool:
        return self.values is None

    @property
    def is_int(self) -> bool:
        """A range of integers: both ends written as integers."""
        return self.is_range and all(isinstance(v, int) for v in (self.low, self.high))

    def as_dict(self) -> Any:
        if self.is_range:
            return {"low": self.low, "high": self.high, "log": self.log}
        return list(self.values or ())


@dataclass(frozen=True)
class Trial:
    """One trial: its name (derived from its values) and the value of each swept key."""

    sweep: str
    name: str
    values: Mapping[str, Any]

    @property
    def run(self) -> str:
        """The trial's run name: its results in ``results/sweeps/<sweep>/<trial>/``."""
        return run_name(self.sweep, self.name)


@dataclass(frozen=True)
class Sweep(SweepSection):
    """The ``sweep:`` section (the run spec's :class:`SweepSection`, its one list of fields),
    checked against the config schema: named, its parameters parsed."""

    name: str
    parameters: tuple[Parameter, ...]  # type: ignore[assignment]

    @property
    def layout(self) -> layout.SweepLayout:
        return layout.SweepLayout(self.name)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.parameters)

    def definition(self) -> dict[str, Any]:
        """What makes two sweeps of one name the same sweep (``definition`` in sweep.json): its
        keys, its method and, for a sampled method, where values are drawn from (grid values
        and ``trials`` may grow)."""
        out: dict[str, Any] = {"keys": list(self.keys), "method": self.method}
        if self.method in SAMPLED:
            out["seed"] = self.seed
            out["parameters"] = {p.key: p.as_dict() for p in self.parameters}
        return out

    def pruning(self) -> dict[str, Any] | None:
        """What a trial's training needs to prune itself (its ``trial.prune``); None: off."""
        if self.prune == "none":
            return None
        return {"method": self.prune, "metric": self.metric, "direction": self.direction,
                "warmup_epochs": self.prune_warmup_epochs}  # fmt: skip


def run_name(sweep: str, trial: str) -> str:
    return f"{layout.SWEEPS}/{sweep}/{trial}"


def _schema_node(key: str) -> dict[str, Any] | None:
    """The schema node of a dotted config key; ``task_args.<anything>`` is free; None: no key."""
    node: dict[str, Any] = schema()
    parts = key.split(".")
    for i, part in enumerate(parts):
        props = node.get("properties", {})
        if part not in props:
            return None
        node = props[part]
        if part == "task_args" and i == 0:
            return node  # the task's own arguments: the task checks them (write_config)
    return node


def _check_key(key: str) -> None:
    top = key.split(".")[0]
    if top in FIXED:
        raise ConfigError(f"sweep.parameters.{key}: {top} cannot vary across trials: {FIXED[top]}")
    node = _schema_node(key)
    if node is None or (node.get("type") == "object" and top != "task_args"):
        raise ConfigError(
            f"sweep.parameters.{key}: not a config key; a parameter is a key by its dotted "
            "path, e.g. train.lr, train.batch_size, launch.nproc_per_node or task_args.<name> "
            "(docs/configuration.md lists every key)"
        )


def _set(cfg: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)


def _check_value(cfg: dict[str, Any], key: str, value: Any, where: str) -> None:
    """Validate the base config with ``key`` set to ``value``; a ConfigError names ``where``."""
    trial = copy.deepcopy(cfg)
    trial.pop("sweep", None)
    _set(trial, key, value)
    try:
        validate(trial)
    except ConfigError as e:
        lines = [line for line in str(e).splitlines() if line.strip().startswith(key)]
        why = "; ".join(line.strip().removeprefix(f"{key}:").strip() for line in lines) or str(e)
        raise ConfigError(f"{where}: {value!r} is not a valid {key}: {why}") from None


_RANGE = {"type": "object", "properties": {"low": {"type": "number"}, "high": {"type": "number"},
                                          "log": {"type": "boolean"}}}  # fmt: skip


def _typed(key: str, spec: Any) -> Any:
    """``spec`` with text values turned into the key's type: ``--config 'sweep={...}'``
    values arrive as text (Snakemake parses nested values with YAML's BaseLoader)."""
    node = _schema_node(key) or {}

    def typed(value: Any) -> Any:
        if key.startswith("task_args.") and isinstance(value, str):
            return yaml.safe_load(value)  # a task's own argument: as YAML would read it
        return coerce(value, node)

    if isinstance(spec, list):
        return [typed(v) for v in spec]
    if isinstance(spec, dict) and isinstance(spec.get("choices"), list):
        return {"choices": [typed(v) for v in spec["choices"]]}
    if isinstance(spec, dict):
        return coerce(dict(spec), _RANGE)
    return spec


def _parameter(cfg: dict[str, Any], key: str, spec: Any, method: str) -> Parameter:
    where = f"sweep.parameters.{key}"
    _check_key(key)
    spec = _typed(key, spec)
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where}: an empty list gives 0 trials; list at least one value")
        for i, value in enumerate(spec):
            _check_value(cfg, key, value, f"{where}[{i}]")
        if len({json.dumps(v, sort_keys=True) for v in spec}) != len(spec):
            raise ConfigError(f"{where}: {spec} lists a value twice; list each value once")
        return Parameter(key, values=tuple(spec))
    if isinstance(spec, dict) and set(spec) == {"choices"}:
        if method not in SAMPLED:
            raise ConfigError(f"{where}: choices are for method random or tpe; a grid lists values")
        return _parameter(cfg, key, spec["choices"], method)
    if isinstance(spec, dict) and {"low", "high"} <= set(spec) <= {"low", "high", "log"}:
        if method not in SAMPLED:
            raise ConfigError(
                f"{where}: a range ({{low, high}}) needs method random or tpe; a grid lists "
                f"its values, e.g. {key}: [0.001, 0.01, 0.1]"
            )
        low, high, log = spec["low"], spec["high"], bool(spec.get("log", False))
        ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
        if not ok or low >= high or (log and low <= 0):
            raise ConfigError(
                f"{where}: {{low: {low}, high: {high}, log: {log}}} is not a range; low and high "
                "are numbers with low < high (and low > 0 with log: true)"
            )
        for end in (low, high):
            _check_value(cfg, key, end, where)
        return Parameter(key, low=low, high=high, log=log)
    raise ConfigError(
        f"{where}: {spec!r} is neither a list of values (a grid axis), a range "
        "{low, high, log} nor {choices: [...]}"
    )


def from_config(cfg: dict[str, Any]) -> Sweep | None:
    """The config's sweep, checked (every key a config key, every value one the schema
    accepts, at least one trial); None without ``sweep.name``. Raise ConfigError."""
    section = cfg.get("sweep") or {}
    if not section.get("name"):
        if section.get("parameters"):
            raise ConfigError("sweep.parameters given without sweep.name: name the sweep")
        return None
    if not section["parameters"]:
        raise ConfigError(
            f"sweep {section['name']}: sweep.parameters is empty, a sweep of 0 trials; map a "
            "config key to its values, e.g. sweep: {parameters: {train.lr: [0.001, 0.01]}}"
        )
    method = section["method"]
    params = tuple(
        _parameter(cfg, key, spec, method) for key, spec in section["parameters"].items()
    )
    return Sweep(
        name=section["name"], parameters=params, method=method, trials=section["trials"],
        seed=section["seed"], metric=section["metric"], direction=section["direction"],
        max_parallel=section["max_parallel"], prune=section["prune"],
        prune_warmup_epochs=section["prune_warmup_epochs"],
        pack=section.get("pack"),
    )  # fmt: skip


def _named(sweep: Sweep, points: list[dict[str, Any]]) -> list[Trial]:
    names = trial_names.distinct(points, sweep.keys)
    return [Trial(sweep.name, n, p) for n, p in zip(names, points, strict=True)]


# -- trials ------------------------------------------------------------------------------


def _grid(sweep: Sweep) -> Iterator[dict[str, Any]]:
    axes = [p.values or () for p in sweep.parameters]
    for combination in itertools.product(*axes):
        yield dict(zip(sweep.keys, combination, strict=True))


def _rounded(value: float) -> float:
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def distributions(sweep: Sweep) -> dict[str, Any]:
    """Each parameter as an Optuna distribution (what the samplers draw from)."""
    from optuna import distributions as d

    out: dict[str, Any] = {}
    for p in sweep.parameters:
        if not p.is_range:
            out[p.key] = d.CategoricalDistribution([json.dumps(v) for v in p.values or ()])
        elif p.is_int:
            out[p.key] = d.IntDistribution(int(p.low), int(p.high), log=p.log)  # type: ignore[arg-type]
        else:
            out[p.key] = d.FloatDistribution(float(p.low), float(p.high), log=p.log)  # type: ignore[arg-type]
    return out


def from_sampled(sweep: Sweep, params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's values from a sampler's draw: choices decoded, floats to their shown digits."""
    out: dict[str, Any] = {}
    for p in sweep.parameters:
        value = params[p.key]
        if not p.is_range:
            value = json.loads(value)
        elif not p.is_int:
            value = _rounded(value)
        out[p.key] = value
    return out


def _random(sweep: Sweep) -> list[dict[str, Any]]:
    """``sweep.trials`` distinct draws of Optuna's random sampler seeded with ``sweep.seed``:
    the same sweep draws the same trials, and a larger ``trials`` the same ones first."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=sweep.seed))
    dists, seen, points = distributions(sweep), set(), []
    for _ in range(sweep.trials * 20):  # a small space may hold fewer distinct trials
        values = from_sampled(sweep, study.ask(dists).params)
        key = json.dumps(values, sort_keys=True)
        if key not in seen:
            seen.add(key)
            points.append(values)
        if len(points) == sweep.trials:
            break
    return points


def trials(sweep: Sweep, suggested: Sequence[Mapping[str, Any]] = ()) -> list[Trial]:
    """The sweep's trials known now: every grid point, the random draws, or a model-based
    method's ``suggested`` ones (its rounds' entries, ``name`` and ``values``:
    :func:`ddppipe.runstate.sweep_rounds.trials` reads them) under the names they were given."""
    if sweep.method == "grid":
        return _named(sweep, list(_grid(sweep)))
    if sweep.method == "random":
        return _named(sweep, _random(sweep))
    return [Trial(sweep.name, trial_names.current_name(e["name"]), e["values"]) for e in suggested]


def apply(cfg: dict[str, Any], sweep: Sweep, trial: Trial) -> dict[str, Any]:
    """The config of ``trial``: the base config (without its sweep) with the trial's values,
    named after it, and what its training needs to know of the sweep (``trial:``)."""
    out = copy.deepcopy(cfg)
    out.pop("sweep", None)
    out.pop("scaling", None)
    for key, value in trial.values.items():
        _set(out, key, value)
    out["run"] = trial.run
    out["trial"] = {"sweep": sweep.name, "name": trial.name, "values": dict(trial.values),
                    "prune": sweep.pruning()}  # fmt: skip
    if sweep.pack is not None:  # (no key otherwise: an unpacked trial's config as before)
        out["trial"]["pack"] = dataclasses.asdict(sweep.pack)
    return out


def check_definition(sweep: Sweep, recorded: Path | None = None) -> None:
    """Refuse a sweep whose name an earlier, different sweep used (its definition file):
    two sweeps never mix in one table. Raise ConfigError naming both definitions."""
    path = recorded or sweep.layout.definition
    if not path.is_file():
        return
    before = json.loads(path.read_text())["definition"]
    now = sweep.definition()
    if before != now:
        raise ConfigError(
            f"sweep {sweep.name}: {path} records another sweep of this name:\n"
            f"  before: {json.dumps(before, sort_keys=True)}\n"
            f"  now:    {json.dumps(now, sort_keys=True)}\n"
            "Give this sweep another sweep.name, or move results/sweeps/"
            f"{sweep.name} away to start it again (grid values and trials may grow; keys, "
            "method, seed and ranges may not)"
        )


DEFAULT_METRICS = ("accuracy", "loss")  # a classification task's evaluation without metrics()


def _task_metrics(task_file: Path) -> tuple[str, ...] | None:
    """The metric names a task file's evaluation writes, read from its source (not imported:
    no torch): the default ones without ``metrics()``, else the string keys of the dicts its
    ``metrics()`` returns and ``loss``; None where its source does not spell them."""
    import ast

    tree = ast.parse(task_file.read_text(), str(task_file))
    hook = next((n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                 and n.name == "metrics"), None)  # fmt: skip
    if hook is None:
        return DEFAULT_METRICS
    names: set[str] = set()
    for node in ast.walk(hook):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            keys = node.value.keys
            if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
                return None
            names.update(k.value for k in keys)  # type: ignore[union-attr]
        elif isinstance(node, ast.Return):
            return None  # a dict built elsewhere: known once the evaluation ran
    return tuple(sorted(names | {"loss"})) if names else None


def check_metric(sweep: Sweep, task_file: str | Path | None) -> None:
    """Refuse a ``sweep.metric`` the task's evaluation does not write (``task_file``: the
    task's source; None for a script, whose logged names are known once it ran)."""
    if task_file is None:
        return
    known = _task_metrics(Path(task_file))
    if known is not None and sweep.metric not in known:
        raise ConfigError(
            f"sweep.metric: {sweep.metric!r} is not a metric of the task's evaluation "
            f"({task_file}); it writes {', '.join(known)}. Set sweep.metric to one of them, or "
            "return it from the task's metrics(output, target)"
        )
