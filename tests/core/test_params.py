"""core/params.py: one field type turns text (a flag, `key=value`, a TOML value) into a value."""
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional  # Optional: the spelling the tests must still accept

import pytest

from core.errors import UserError
from core.params import (
    Bounds,
    build_params,
    check_fields,
    conforms,
    convert,
    field_default,
    optional_of,
    param,
    parse_items,
)


def test_optional_both_spellings():
    for t in (Optional[int], int | None):  # noqa: UP045  (both spellings are the test)
        assert optional_of(t) is int
        assert convert("3", t, "seed") == 3
        assert convert("", t, "seed") is None and convert("None", t, "seed") is None
        assert convert(None, t, "seed") is None
        with pytest.raises(UserError, match="seed: 'x' is not an integer"):
            convert("x", t, "seed")
    assert optional_of(int) is None and optional_of(Literal["a"]) is None
    with pytest.raises(TypeError, match="only X | None"):
        optional_of(int | str)


def test_none_is_a_value_for_optional_strings():
    assert convert("none", str | None, "weights") == "none"
    assert convert("", Optional[str], "weights") is None  # noqa: UP045  (the old spelling still converts)


def test_literal_plain_and_optional():
    t = Literal["abs", "clip"]
    assert convert("clip", t, "psd") == "clip"
    with pytest.raises(UserError, match=r"psd: 'both' is not one of \['abs', 'clip'\]"):
        convert("both", t, "psd")
    assert convert("", t | None, "psd") is None and convert("abs", Optional[t], "psd") == "abs"  # noqa: UP045  (the old spelling)


def test_tuples_from_text_and_lists():
    assert convert("1,2, 3", tuple[int, ...], "ks") == (1, 2, 3)
    assert convert([0.5, 1], tuple[float, ...], "w") == (0.5, 1.0)
    assert convert("", tuple[str, ...], "tags") == () and convert("a,,b", tuple[str, ...], "tags") == ("a", "b")
    assert convert("2,x", tuple[int, str], "pair") == (2, "x")
    with pytest.raises(UserError, match=r"pair: '2' is not 2 comma-separated values"):
        convert("2", tuple[int, str], "pair")
    with pytest.raises(UserError, match="ks: 'x' is not an integer"):
        convert("1,x", tuple[int, ...], "ks")
    assert convert("abs,clip", tuple[Literal["abs", "clip"], ...], "psd") == ("abs", "clip")


def test_scalars():
    assert convert("yes", bool, "b") is True and convert("0", bool, "b") is False and convert(True, bool, "b")
    with pytest.raises(UserError, match="b: 'maybe' is not a boolean"):
        convert("maybe", bool, "b")
    assert convert("2.5", float, "lr") == 2.5 and convert(7, str, "s") == "7"
    with pytest.raises(UserError, match="lr: 'fast' is not a number"):
        convert("fast", float, "lr")


def test_conforms_checks_declared_values():
    assert conforms((0.0, 0.5), tuple[float, ...]) and not conforms([0.0], tuple[float, ...])
    assert conforms(1, float) and not conforms(True, float) and not conforms(1.0, int)
    assert conforms({"r": (0.1,)}, Mapping[str, tuple]) and not conforms({"r": [0.1]}, Mapping[str, tuple])
    assert conforms(None, Mapping[str, Any] | None) and conforms({}, dict[str, Any])
    assert conforms("spectral", Literal["spectral", "dense"]) and not conforms("spectra", Literal["spectral"])
    assert not conforms("yes", bool)


@dataclass
class P:
    k: int = param(3, "how many")
    tags: tuple[str, ...] = ()
    seed: int | None = None
    mode: Literal["a", "b"] = "a"
    extra: list = field(default_factory=list)


def test_build_params_and_defaults():
    p = build_params(P, parse_items(["k=5", "tags=x,y", "seed=", "mode=b"], "p"), "p")
    assert (p.k, p.tags, p.seed, p.mode) == (5, ("x", "y"), None, "b")
    with pytest.raises(UserError, match=r"p: no parameter 'kk'; valid: \['k', 'tags', 'seed', 'mode', 'extra'\]"):
        build_params(P, {"kk": "1"}, "p")
    from dataclasses import fields
    assert [field_default(f) for f in fields(P)] == [3, (), None, "a", []]
    assert fields(P)[0].metadata["help"] == "how many"
    assert parse_items(["reg.w=1", "other.w=2"], "r", prefix="reg") == {"w": "1"}


@dataclass
class _Bounded:
    r: float = param(0.5, "a degree", bounds="[0, 1]", step=0.05)
    k: int = param(3, "a size", bounds="[1, inf)")
    t: float = param(1.0, "a scale", bounds="(0, inf)")
    w: tuple[float, ...] = param((), "weights", bounds="[0, inf)")
    free: float = param(0.0, "may be infinite", nonfinite=True)
    how: Literal["a", "b"] = param("a", "a choice")


@pytest.mark.parametrize("given, message", [
    ({"r": "1.5"}, r"x: r must be in \[0, 1\], got 1.5"),
    ({"r": "-0.01"}, r"x: r must be in \[0, 1\], got -0.01"),
    ({"k": "0"}, "x: k must be ≥ 1, got 0"),
    ({"t": "0"}, "x: t must be > 0, got 0.0"),
    ({"w": "1,-2"}, "x: w must be ≥ 0, got -2.0"),
    ({"r": "nan"}, "x: r must be a finite number, got nan"),
    ({"t": "inf"}, "x: t must be a finite number, got inf"),
    ({"w": "1,inf"}, "x: w must be a finite number, got inf"),
])
def test_bounds_and_finiteness_are_enforced(given, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        build_params(_Bounded, given, "x")


def test_values_on_the_bounds_and_declared_infinities_pass():
    p = build_params(_Bounded, {"r": "0", "k": "1", "t": "1e-9", "w": "0,0", "free": "-inf"}, "x")
    assert (p.r, p.k, p.t, p.w, p.free) == (0.0, 1, 1e-9, (0.0, 0.0), float("-inf"))
    assert build_params(_Bounded, {"r": "1"}, "x").r == 1.0


def test_check_fields_covers_direct_construction_and_names_flags():
    with pytest.raises(UserError, match=r"^--how must be one of \['a', 'b'\], got 'c'$"):
        check_fields(_Bounded(how="c"), "", name=lambda n: "--" + n)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="^s: k must be ≥ 1, got -3$"):
        check_fields(_Bounded(k=-3), "s")
    check_fields(_Bounded(), "s")  # the defaults lie inside their own bounds


@pytest.mark.parametrize("text, inside, outside, shown", [
    ("[0, 1]", (0, 0.5, 1), (-1e-9, 1.0001), "in [0, 1]"),
    ("(0, 1)", (1e-9, 0.999), (0, 1), "in (0, 1)"),
    ("[2, inf)", (2, 1e12), (1.999,), "≥ 2"),
    ("(-inf, 4]", (-1e12, 4), (4.0001,), "≤ 4"),
])
def test_bounds_parse_and_contain(text, inside, outside, shown):
    b = Bounds.parse(text)
    assert all(v in b for v in inside) and not any(v in b for v in outside)
    assert b.describe() == shown


@pytest.mark.parametrize("text", ["0, 1", "[1, 0]", "[a, 1]", "[0 1]"])
def test_malformed_bounds_are_a_declaration_error(text):
    with pytest.raises(ValueError):
        param(0.0, "x", bounds=text)


def test_every_declared_default_lies_inside_its_bounds():
    """Each registry entry's and each typed configuration's defaults pass their own bounds, and
    every declared numeric bound is a parsed interval (no declaration escapes the one form)."""
    from data import DataConfig
    from index.build_config import BuildConfig
    from index.refinements import REFINEMENTS
    from index.rerankers import RERANKERS
    from training.config import TrainConfig
    from training.losses import LOSSES
    from training.regularizers import REGULARIZERS

    checked = 0
    for reg in (REFINEMENTS, RERANKERS, LOSSES, REGULARIZERS):
        for e in reg.entries():
            check_fields(e.params(), e.what)
            checked += 1
    for cls in (DataConfig, BuildConfig, TrainConfig):
        check_fields(cls(), cls.__name__)
    assert checked >= 15


def test_a_named_value_is_accepted_and_shown_as_its_word():
    from core.params import shown, shown_params

    @dataclass(frozen=True)
    class P:
        pool: int = param(1_000_000_000, "candidates", bounds="[1, inf)", named={"all": 1_000_000_000})
        k: int = param(5, "k")

    assert build_params(P, {"pool": "all"}, "p").pool == 1_000_000_000
    assert build_params(P, {"pool": " ALL "}, "p").pool == 1_000_000_000
    assert build_params(P, {"pool": "30"}, "p").pool == 30
    with pytest.raises(UserError, match="is not an integer"):
        build_params(P, {"k": "all"}, "p")  # a word only where the field declares it
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(P)}
    assert shown(fields["pool"], 1_000_000_000) == "all" and shown(fields["pool"], 30) == 30
    assert shown_params(P()) == {"pool": "all", "k": 5}
    assert shown_params(P(pool=7)) == {"pool": 7, "k": 5}
