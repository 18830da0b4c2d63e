"""The run folder: what may be written there, its recorded config, checkpoints and resume.

A run folder holds `config.toml` (the run's whole config, which `--config` reads
back), `latest.pt` (every epoch, with optimizer state: what `--resume` continues),
`best.pt` (the validation-selected model), `log.jsonl`, `metrics.json` and
`curve.png`.  An existing run is replaced only with `--overwrite`; a folder that
is not a run of ours is never written into.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tomllib
from pathlib import Path

from core.atomic import write_text
from core.config import config_toml, read_config_file
from core.errors import UserError
from model.checkpoint import save_checkpoint

from .config import RUNTIME_FIELDS, TrainConfig

log = logging.getLogger("training")

OURS = ("latest.pt", "best.pt", "config.toml", "config.json", "log.jsonl", "metrics.json")


def recorded_config(out: Path) -> dict | None:
    """The config a run folder records (config.toml; runs before it wrote config.json), else None."""
    if (out / "config.toml").is_file():
        values = read_config_file(TrainConfig, out / "config.toml")
        # core's reader turns the string "none" of an optional field into None, but `weights = "none"`
        # (no pretrained weights) is not `weights` unset (the backbone's default); keep the string
        raw = tomllib.loads((out / "config.toml").read_text(encoding="utf-8"))
        values = values | {k: v for k, v in raw.items() if isinstance(v, str) and v and values.get(k) is None}
        if values.get("probe_epochs", 0) < 0:  # "the mode's default" is the probe that ran: defaults change
            try:
                first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
                values["probe_epochs"] = first.get("probe_epochs", 0) if first.get("epoch") == 0 else 0
            except (OSError, ValueError, IndexError):
                pass  # no epoch logged yet: nothing there to reuse or resume
        return values
    if (out / "config.json").is_file():
        try:
            return json.loads((out / "config.json").read_text())
        except ValueError:
            return None
    return None


def same_identity(recorded: dict, cfg: TrainConfig) -> bool:
    """Same result-deciding settings.  A setting the recorded run predates (e.g. --train-blocks) is
    taken at its default, which is what that run did: older runs stay reusable and resumable."""
    old = {k: v for k, v in recorded.items() if k not in RUNTIME_FIELDS}
    old.setdefault("probe_epochs", 0)  # runs before --probe-epochs had no probe
    old = {k: v for k, v in TrainConfig().identity().items() if k not in old} | old
    held = TrainConfig(**{k: old[k] for k in ("neck_lr_mult", "regularizer", "loss")})
    if held.probe_has_nothing_to_train():  # the run skipped its probe, whatever the file asked for
        old["probe_epochs"] = 0
    if old["probe_epochs"] < 0:  # a config file may say -1 ("the mode's default")
        old["probe_epochs"] = TrainConfig(**{k: old[k] for k in ("mode", "train_blocks", "backbone", "weights")}
                                          ).resolved_probe_epochs()
    return json.loads(json.dumps(old)) == json.loads(json.dumps(cfg.identity()))


def check_out(cfg: TrainConfig) -> bool:
    """Refuse an --out that this run may not write into; True when there is a run to resume.
    Called before anything is written."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a run folder")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    if not any((out / f).is_file() for f in OURS):
        raise UserError(f"--out {out} holds files that are not a training run; choose another folder "
                        "(--overwrite replaces only a run folder)")
    if cfg.resume:
        if not (out / "latest.pt").is_file():
            log.info("nothing to resume in %s; starting fresh", out)
            return False
        recorded = recorded_config(out)
        if recorded is None or not same_identity(recorded, cfg):
            name = "config.toml" if (out / "config.toml").is_file() else "config.json"
            raise UserError(f"cannot resume {out}: its {name} differs from this run's config")
        return True
    if not cfg.overwrite:
        raise UserError(f"--out {out} already holds a training run; pass --resume to continue it or "
                        "--overwrite to replace it")
    return False


def write_config(out: Path, cfg: TrainConfig) -> None:
    """config.toml: passed back with --config, it reproduces the run."""
    fresh = dataclasses.replace(cfg, resume=False, overwrite=False)
    write_text(out / "config.toml", config_toml(fresh, "training run config: python -m training train "
                                                      "--config config.toml [--out NEW_FOLDER]"))


class Checkpoints:
    """Saving and restoring a run's state (model, loss, regularizers, optimizer, schedule)."""

    def __init__(self, out: Path, cfg: TrainConfig, model, loss, loss_params: dict, regs, opt, sched,
                 label_map: dict, data_record: dict, split_record: dict):
        self.out, self.cfg, self.model, self.loss, self.loss_params = out, cfg, model, loss, loss_params
        self.regs, self.opt, self.sched, self.label_map = regs, opt, sched, label_map
        self.data_record, self.split_record = data_record, split_record

    def _extra(self, epoch: int, best: float, best_epoch: int, history: list, with_opt: bool) -> dict:
        extra = {"loss_name": self.cfg.loss, "loss_params": self.loss_params,
                 "loss_state": {k: v.detach().cpu() for k, v in self.loss.state_dict().items()},
                 "label_map": [[int(k), int(v)] for k, v in self.label_map.items()],
                 "regularizers": {r.name: r.export() for r in self.regs},
                 "epoch": epoch, "best": best, "best_epoch": best_epoch, "history": history}
        if with_opt:
            extra["optimizer"] = self.opt.state_dict()
            if self.sched is not None:  # None: a constant learning rate
                extra["scheduler"] = self.sched.state_dict()
            extra["reg_state"] = {r.name: {k: v.detach().cpu() for k, v in r.module.state_dict().items()}
                                  for r in self.regs}
        return extra

    def save(self, name: str, epoch, best, best_epoch, history, metrics=None, with_opt=False) -> None:
        save_checkpoint(self.out / name, self.model, config=dataclasses.asdict(self.cfg),
                        split=self.split_record, metrics=metrics or {}, data=self.data_record,
                        extra=self._extra(epoch, best, best_epoch, history, with_opt))

    def restore(self, ck: dict) -> tuple[int, float, int, list]:
        """Load a latest.pt; returns (epochs done, best val MAP@R, its epoch, history)."""
        self.model.load_state_dict(ck["state_dict"])
        ex = ck["extra"]
        self.loss.load_state_dict(ex["loss_state"])
        for r in self.regs:
            r.module.load_state_dict(ex["reg_state"][r.name])
        self.opt.load_state_dict(ex["optimizer"])
        if self.sched is not None:
            self.sched.load_state_dict(ex["scheduler"])
        return ex["epoch"], ex["best"], ex["best_epoch"], ex["history"]
