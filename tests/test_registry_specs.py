"""Each registry's typed metadata: registering with a keyword its spec does not have, without a
required one, with a value of the wrong kind, or under a name taken already, fails at import."""
import importlib.util
import sys
from dataclasses import dataclass

import pytest

from core.registry import Spec
from data.registry import DATASETS, DatasetSpec
from index.refinements.registry import REFINEMENTS, StrategySpec
from index.rerankers.registry import RERANKERS, RerankerSpec
from model.backbones.registry import BACKBONES, BackboneSpec
from training.losses.registry import LOSSES, LossSpec
from training.regularizers.registry import REGULARIZERS, RegularizerSpec

REGISTRIES = [(BACKBONES, BackboneSpec), (DATASETS, DatasetSpec), (LOSSES, LossSpec),
              (REGULARIZERS, RegularizerSpec), (REFINEMENTS, StrategySpec), (RERANKERS, RerankerSpec)]


@pytest.mark.parametrize("reg,spec", REGISTRIES, ids=lambda r: getattr(r, "kind", getattr(r, "__name__", "")))
def test_every_registry_declares_its_spec(reg, spec):
    assert reg.spec_type is spec and issubclass(spec, Spec) and spec is not Spec
    assert len(reg) and all(isinstance(e.spec, spec) for e in reg.entries())


def test_a_typo_in_a_registration_fails_when_its_module_is_imported(tmp_path):
    (tmp_path / "typo_strategy.py").write_text(
        "from index.refinements.registry import REFINEMENTS\n\n\n"
        "@REFINEMENTS.register('typo', opertor='dense')\n"
        "def typo(M, p):\n    return M\n")
    spec = importlib.util.spec_from_file_location("typo_strategy", tmp_path / "typo_strategy.py")
    with pytest.raises(TypeError, match=r"refinement strategy 'typo': unknown keyword 'opertor' for StrategySpec; "
                                        r"it takes operator, grid, modes, trained_at, exact_symmetry"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "typo" not in REFINEMENTS and "typo_strategy" not in sys.modules


@dataclass
class GammaParams:
    gamma: float = 0.5


def test_strategy_spec_refuses_what_would_be_silently_ignored():
    def ident(M, p):
        return M

    with pytest.raises(ValueError, match=r"'x': operator='lowrnak' is not"):
        REFINEMENTS.register("x", operator="lowrnak")(ident)
    with pytest.raises(ValueError, match=r"'x': grid names \['gama'\], which are not its parameters \['gamma'\]"):
        REFINEMENTS.register("x", GammaParams, grid={"gama": (0.0, 1.0)})(ident)
    with pytest.raises(ValueError, match=r"'x': trained_at names \['g'\]"):
        REFINEMENTS.register("x", GammaParams, trained_at={"g": 0.0})(ident)
    with pytest.raises(ValueError, match=r"'x': modes must be some of \['bilinear', 'cosine'\]"):
        REFINEMENTS.register("x", modes=("cosin",))(ident)
    with pytest.raises(ValueError, match=r"'x': grid=\{'gamma': \[0.0, 1.0\]\} is not"):
        REFINEMENTS.register("x", GammaParams, grid={"gamma": [0.0, 1.0]})(ident)
    assert "x" not in REFINEMENTS


def test_other_specs_refuse_missing_and_mistyped_values():
    with pytest.raises(TypeError, match="regularizer 'x': RegularizerSpec needs 'weight'"):
        REGULARIZERS.register("x")
    with pytest.raises(ValueError, match="regularizer 'x': weight='0.1' is not float"):
        REGULARIZERS.register("x", weight="0.1")(object)
    with pytest.raises(TypeError, match="backbone 'x': BackboneSpec needs 'stages'"):
        BACKBONES.register("x")
    with pytest.raises(ValueError, match="backbone 'x': default_weights='imagnet' is not"):
        BACKBONES.register("x", stages=("a",), default_weights="imagnet")(lambda weights=None: None)
    with pytest.raises(ValueError, match="data set 'x': image_size must be 16 … 2048, got 8"):
        DATASETS.register("x", image_size=8)(lambda cfg, progress=True: None)
    with pytest.raises(ValueError, match="loss 'x': proxies=1 is not bool"):
        LOSSES.register("x", proxies=1)(lambda C, d, p: None)
    assert all("x" not in reg for reg, _ in REGISTRIES)


def test_a_name_taken_already_is_refused():
    with pytest.raises(
        ValueError, match=r"loss 'triplet' is registered already \(by training.losses.pml_losses.triplet\)"
    ):
        LOSSES.register("triplet")(lambda C, d, p: None)
    assert LOSSES.get("triplet").builder.__module__ == "training.losses.pml_losses"
