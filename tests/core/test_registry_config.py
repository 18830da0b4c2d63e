"""core/registry.py (the one registry shape) and core/config.py (typed config ⇄ argparse ⇄ TOML)."""
import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from core.config import add_config_args, config_from_args, config_toml, parse_with_config_file, read_config_file
from core.errors import UserError
from core.registry import Registry, Spec


@dataclass
class WidgetParams:
    size: int = field(default=3, metadata={"help": "how big"})
    scale: float = 0.5
    loud: bool = False

    def validate(self):
        if self.size < 1:
            raise UserError(f"size must be ≥ 1, got {self.size}")


@dataclass(frozen=True, kw_only=True)
class WidgetSpec(Spec):
    colour: str = "grey"
    sides: int

    def listing_lines(self) -> list[str]:
        return [f"sides: {self.sides}"]


def make_registry() -> Registry:
    reg = Registry("widget", spec=WidgetSpec)

    @reg.register("round", WidgetParams, sides=0)
    def round_(p):
        """A round widget.

        More text that is not the doc line."""
        return ("round", p.size)

    @reg.register("flat", doc="a flat one", colour="blue", sides=4)
    def flat(p):
        return "flat"
    return reg


def test_entries_docs_spec_and_build():
    reg = make_registry()
    assert reg.names() == ["flat", "round"] and "round" in reg and len(reg) == 2
    assert reg.get("round").doc == "A round widget."
    assert reg.get("flat").spec == WidgetSpec(colour="blue", sides=4)
    assert reg.get("round").spec == WidgetSpec(sides=0)  # colour: its default
    assert reg.build("round", reg.params("round", {"size": "7"})) == ("round", 7)
    with pytest.raises(UserError, match="unknown widget 'square'; choose from flat, round"):
        reg.get("square")


def test_registering_a_name_twice_is_an_error():
    reg = make_registry()
    with pytest.raises(ValueError, match=r"widget 'flat' is registered already \(by .*flat\)"):
        reg.register("flat", sides=3)(lambda p: "another flat")
    assert reg.build("flat", None) == "flat"  # the first entry stays
    reg.unregister("flat")
    reg.register("flat", sides=3)(lambda p: "another flat")  # free again once unregistered
    assert reg.build("flat", None) == "another flat" and reg.get("flat").spec.sides == 3


def test_unknown_missing_or_mistyped_metadata_is_an_error():
    reg = make_registry()
    with pytest.raises(TypeError, match=r"widget 'oval': unknown keyword 'color' for WidgetSpec; "
                                        r"it takes colour, sides"):
        reg.register("oval", sides=0, color="red")
    with pytest.raises(TypeError, match=r"widget 'oval': WidgetSpec needs 'sides'"):
        reg.register("oval", colour="red")
    with pytest.raises(ValueError, match=r"widget 'oval': sides='three' is not int"):
        reg.register("oval", sides="three")(lambda p: "oval")
    with pytest.raises(TypeError, match="unknown keyword 'colour' for Spec; it takes none"):
        Registry("plain", spec=Spec).register("x", colour="blue")  # the base spec: no metadata
    assert "oval" not in reg
    with pytest.raises(TypeError, match="spec must be a frozen dataclass derived from Spec"):
        Registry("bad", spec=WidgetParams)


def test_typed_params_refuse_unknown_keys_and_bad_values():
    reg = make_registry()
    p = reg.params("round", ["size=4", "scale=0.25", "loud=yes"])
    assert (p.size, p.scale, p.loud) == (4, 0.25, True)
    with pytest.raises(UserError, match=r"no parameter 'colour'; valid: \['size', 'scale', 'loud'\]"):
        reg.params("round", ["colour=red"])
    with pytest.raises(UserError, match="size: 'big' is not an integer"):
        reg.params("round", {"size": "big"})
    with pytest.raises(UserError, match="loud: 'maybe' is not a boolean"):
        reg.params("round", {"loud": "maybe"})
    with pytest.raises(UserError, match="size must be ≥ 1"):
        reg.params("round", {"size": 0})
    with pytest.raises(UserError, match="want key=value"):
        reg.params("round", ["size"])
    assert reg.params("round", {"colour": "red"}, ignore_unknown=True).size == 3


def test_listing_and_help_name_every_entry_and_parameter():
    reg = make_registry()
    text = reg.listing()
    assert "round" in text and "A round widget." in text and "size = 3  how big" in text
    assert "flat" in text and "a flat one" in text
    assert "  flat                 a flat one\n      sides: 4\n" in text  # the spec's own lines
    assert reg.params_help() == "round: size=3, scale=0.5, loud=False"
    assert reg.describe()[1]["params"]["size"] == {"default": 3, "help": "how big"}


def test_argparse_choices_help_and_refusal(capsys):
    reg = make_registry()
    p = argparse.ArgumentParser(prog="x")
    reg.add_argument(p, "--widget", default="round", help="the widget (100% useful)")
    reg.add_argument(p, "--widgets", default=(), many=True, help="several")
    assert p.parse_args(["--widget", "flat"]).widget == "flat"
    assert p.parse_args(["--widgets", "flat,round"]).widgets == ("flat", "round")
    help_text = p.format_help()
    assert "round: A round widget." in help_text and "flat: a flat one" in help_text
    assert "100% useful" in help_text and "(default: round)" in help_text
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--widgets", "flat,square"])
    assert e.value.code == 2
    assert "unknown widget 'square'" in capsys.readouterr().err


@dataclass
class RunConfig:
    name: str = field(default="run", metadata={"help": "the name"})
    root: str | None = None
    epochs: int = 3
    lr: float = 1e-3
    tags: tuple[str, ...] = ()
    ks: tuple[int, ...] = (1, 2)
    mode: Literal["a", "b"] = "a"
    fast: bool = True


def test_toml_round_trip_and_refusals(tmp_path):
    cfg = RunConfig(name='quote " and ü', root=None, epochs=7, lr=2.5e-5, tags=("x", "y"), ks=(4,),
                    mode="b", fast=False)
    path = tmp_path / "c.toml"
    path.write_text(config_toml(cfg, header="written by a test"))
    assert RunConfig(**read_config_file(RunConfig, path)) == cfg
    (tmp_path / "bad.toml").write_text("epochs = 3\ncolour = 'red'\n")
    with pytest.raises(UserError, match="unknown setting 'colour'"):
        read_config_file(RunConfig, tmp_path / "bad.toml")
    (tmp_path / "bad2.toml").write_text("epochs = 'many'\n")
    with pytest.raises(UserError, match="epochs: 'many' is not an integer"):
        read_config_file(RunConfig, tmp_path / "bad2.toml")
    (tmp_path / "bad3.toml").write_text("epochs = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        read_config_file(RunConfig, tmp_path / "bad3.toml")
    with pytest.raises(UserError, match="config file not found"):
        read_config_file(RunConfig, tmp_path / "nope.toml")


def test_flags_override_the_config_file(tmp_path):
    (tmp_path / "c.toml").write_text("epochs = 9\nlr = 0.5\ntags = ['a']\n")

    def build_parser(defaults=None):
        p = argparse.ArgumentParser()
        sub = p.add_subparsers(dest="command", required=True)
        t = sub.add_parser("train")
        t.add_argument("--config")
        add_config_args(t, RunConfig, defaults=(defaults or {}).get("train"))
        return p

    args = parse_with_config_file(build_parser, ["train", "--config", str(tmp_path / "c.toml"), "--lr", "0.1"],
                                  {"train": RunConfig})
    cfg = config_from_args(RunConfig, args)
    assert (cfg.epochs, cfg.lr, cfg.tags, cfg.name) == (9, 0.1, ("a",), "run")
    assert "(default: 9)" in build_parser({"train": {"epochs": 9}})._subparsers._group_actions[0].choices[
        "train"].format_help()


def test_none_is_a_value_for_optional_strings_and_empty_means_unset():
    from core.params import convert

    assert convert("none", str | None, "weights") == "none"   # --weights none: no pretrained weights
    assert convert("", str | None, "weights") is None
    assert convert("none", int | None, "seed") is None and convert("3", int | None, "seed") == 3
