"""The app's controls: components built from the registries' metadata (a control per strategy
and re-ranker parameter, its range from the parameter's declared bounds), each panel's
configuration controls, the search API's hidden inputs, the query upload and the clickable
plots.  No handler and no layout: app/handlers.py answers their events, app/ui.py places them."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import gradio as gr

from index.refinements import MODES, SharedParam, shared_params
from index.rerankers import AUTO, RERANKERS, WHOLE_GALLERY
from index.search_config import NO_RERANK, SearchConfig

from .params import ALL, AUTO_WORD, api_params, shown
from .service import RetrievalService


def UploadImage(**kw) -> gr.Image:
    """A gr.Image that hands us the uploaded file untouched: our own loader decodes it
    (all modes, EXIF, bomb limit) and reports a broken file clearly, instead of
    Gradio's preprocessing failing with a generic error.  An instance override, not a
    subclass: Gradio writes a .pyi stub beside the module of every component subclass,
    and nothing may write into the source tree at run time."""
    img = gr.Image(**kw)
    base = img.preprocess

    def preprocess(payload):
        if payload is not None and getattr(payload, "path", None):
            return str(payload.path)
        return base(payload)

    img.preprocess = preprocess  # type: ignore[method-assign]  # this instance's own, as above
    return img


SIDES = ("left", "right")


def rerank_key(side: str, rerank: str, param: str) -> str:
    """The handlers' keyword name of one re-ranker parameter's control: `<side>_rerank_<name>__<param>`
    (a control per re-ranker and parameter: each has its own default and help)."""
    return f"{side}_rerank_{rerank}__{param}"


def visible_params(strategy: str) -> dict[str, bool]:
    """Which parameter controls the strategy uses (SharedParam.defaults: the strategies taking each)."""
    return {sp.name: strategy in sp.defaults for sp in shared_params()}


def rerank_controls() -> list[tuple[str, SharedParam]]:
    """A control per (re-ranker, parameter), in registry order: (re-ranker name, the parameter as
    a SharedParam of that one re-ranker, for `param_control`)."""
    out = []
    for e in RERANKERS.entries():
        hints = typing.get_type_hints(e.params)
        for f in dataclasses.fields(e.params):
            out.append((e.name, SharedParam(f.name, hints[f.name], f.metadata, {e.name: e.param_defaults()[f.name]})))
    return out


def param_control(sp: SharedParam, api: bool = False, visible: bool = True):
    """The control for one strategy parameter, from its registry metadata: a file upload,
    a slider over its bounds (where both ends are finite; the bounds validation enforces), else a
    number or text box.  `api`: a plain value."""
    label = sp.name if api else f"{sp.name}: {sp.describe()}".replace(str(AUTO), AUTO_WORD).replace(
        str(WHOLE_GALLERY), ALL)
    bounds = sp.metadata.get("bounds")
    if sp.metadata.get("file"):
        return gr.File(label=label, file_types=list(sp.metadata["file"]), type="filepath", visible=visible)
    if bounds is not None and bounds.finite() and not api:
        lo, hi = bounds.finite()
        return gr.Slider(lo, hi, sp.default, step=sp.metadata.get("step", (hi - lo) / 20), label=label,
                         visible=visible)
    if typing.get_origin(sp.type) is typing.Literal:  # a fixed set of values: choose, don't type
        return gr.Dropdown(list(typing.get_args(sp.type)), value=sp.default, label=label, visible=visible)
    if sp.type is int and isinstance(sp.default, int) and sp.default >= WHOLE_GALLERY:
        # the whole gallery "all", or "auto" (app.params.spec_from reads both back), or a number
        words = f"'{ALL}', '{AUTO_WORD}'" if sp.default == AUTO else f"'{ALL}'"
        return gr.Textbox(shown(sp.default), label=f"{label} ({words} or a number)", visible=visible)
    if sp.type in (int, float):  # out-of-bounds values reach validation, which names the bounds
        return gr.Number(sp.default, precision=0 if sp.type is int else None, label=label, visible=visible)
    return gr.Textbox(sp.default, label=label, visible=visible)


def api_controls(svc: RetrievalService) -> dict:
    """The /search API's inputs, by parameter name in the API's stable order (`api_params()`):
    plain values, each at its default; file parameters are left out."""
    params = {sp.name: sp for sp in shared_params()}
    own = {"image": lambda: UploadImage(type="filepath", label="image"),
           "strategy": lambda: gr.Dropdown(svc.strategy_choices(with_files=False), value="trained", label="strategy"),
           "mode": lambda: gr.Dropdown(list(MODES), value="cosine", label="mode"),  # the CLI's defaults
           "k": lambda: gr.Number(10, precision=0, label="k"),
           "rerank": lambda: gr.Dropdown(RERANKERS.names(), value=NO_RERANK, label="rerank"),
           "rerank_params": lambda: gr.Textbox("", label="rerank_params")}  # "n=3, alpha=1" or a JSON object
    return {name: own[name]() if name in own else param_control(params[name], api=True) for name in api_params()}


@dataclasses.dataclass
class ConfigControls:
    """One panel's configuration: strategy, mode, and a control per strategy parameter (only the
    chosen strategy's shown, in `group`); its re-ranker and a control per re-ranker parameter
    (only the chosen re-ranker's shown, in `rerank_group`)."""
    side: str
    strategy: gr.Dropdown
    mode: gr.Radio
    group: gr.Accordion
    controls: dict
    rerank: gr.Dropdown
    rerank_group: gr.Accordion
    rerank_controls: dict  # (re-ranker, parameter) → control, in `rerank_controls()`'s order

    @property
    def kwargs(self) -> dict:
        """The handlers' keyword inputs (`config_from` reads them back)."""
        return {f"{self.side}_strategy": self.strategy, f"{self.side}_mode": self.mode,
                **{f"{self.side}_{name}": c for name, c in self.controls.items()},
                f"{self.side}_rerank": self.rerank,
                **{rerank_key(self.side, r, p): c for (r, p), c in self.rerank_controls.items()}}

    @property
    def components(self) -> list:
        """In `on_load`'s order: strategy, mode, each parameter control, re-ranker, each re-ranker
        parameter control."""
        return [self.strategy, self.mode, *self.controls.values(), self.rerank, *self.rerank_controls.values()]


def config_controls(svc: RetrievalService, side: str, spec: SearchConfig) -> ConfigControls:
    strategy = gr.Dropdown(svc.strategy_choices(), value=spec.strategy, label=f"{side.capitalize()} strategy",
                           elem_id=f"{side}-strategy")
    mode = gr.Radio(list(reversed(MODES)), value=spec.mode, label=f"{side.capitalize()} mode", elem_id=f"{side}-mode")
    shown = visible_params(spec.strategy)
    with gr.Accordion(f"{side.capitalize()} strategy parameters", open=True, visible=any(shown.values())) as group:
        controls = {sp.name: param_control(sp, visible=shown[sp.name]) for sp in shared_params()}
    rerank = gr.Dropdown([(NO_RERANK if e.name == NO_RERANK else f"{e.name} — {e.doc.split(':')[0]}", e.name)
                          for e in RERANKERS.entries()], value=spec.rerank,
                         label=f"{side.capitalize()} re-ranker", elem_id=f"{side}-rerank")
    owned = [name == spec.rerank for name, _ in rerank_controls()]
    with gr.Accordion(f"{side.capitalize()} re-ranker parameters", open=True, visible=any(owned)) as rerank_group:
        rr = {(name, sp.name): param_control(sp, visible=v)
              for (name, sp), v in zip(rerank_controls(), owned, strict=True)}
    return ConfigControls(side, strategy, mode, group, controls, rerank, rerank_group, rr)


# The page's scripts, kept as JavaScript files beside this module (Gradio takes them as source text):
STATIC = Path(__file__).resolve().parent / "static"
# plot.js: a click on a point (any element with data-id) → the component's "click" event with {id};
# hovering shows the point's tooltip with its thumbnail, fetched through a server function
PLOT_JS = (STATIC / "plot.js").read_text()


class PointClick(gr.EventData):
    """A click on a plot point: plot.js triggers "click" with {id}, Gradio builds this with (target, data)
    as it builds every EventData subclass; `id` is the point's gallery item."""

    def __init__(self, target, data):
        super().__init__(target, data)
        self.id = int(data["id"])


def plot_html(svc: RetrievalService, elem_id: str) -> gr.HTML:
    """An SVG plot whose points open a query when clicked (see plot.js)."""
    def thumb(item_id):
        return svc.thumbnail_uri(int(item_id))
    return gr.HTML("", js_on_load=PLOT_JS, server_functions=[thumb], elem_id=elem_id, min_height=120)
