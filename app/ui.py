"""The Gradio Blocks UI.  Handlers are thin: they call RetrievalService and turn
UserErrors into a visible message, so a bad upload never stops the app."""
from __future__ import annotations

import dataclasses
import logging
import os
import typing
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import numpy as np

from core.errors import UserError
from index.backends.gallery import RESULT_FIELDS
from index.refinements import MODES, REFINEMENTS, SharedParam, file_params, shared_params, strategy_params
from index.rerankers import RERANKERS, reranker_params
from index.search_config import NO_RERANK, SearchConfig

from .compare_view import MAP_METHODS, SCATTER_COLOURS, parse_state, state_query, write_exports
from .service import DEFAULT_RIGHT, Panel, RetrievalService, Spec, jaccard, rerank_params_from
from .why_view import why_html

log = logging.getLogger("app")


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

    img.preprocess = preprocess
    return img


def spec_from(strategy, mode, values: dict, rerank: str = NO_RERANK, rerank_params: dict | None = None) -> Spec:
    """A configuration from the parameter controls' values (every strategy's, by name): the chosen
    strategy's typed parameters, so that its label shows exactly what was searched, and the
    re-ranker's (only its own: another key is refused with the ones it takes)."""
    for name in file_params(strategy):
        if not values.get(name):
            raise UserError(f"strategy {strategy}: upload {REFINEMENTS.get(strategy).param_help()[name]} first")
    rerank = rerank or NO_RERANK
    given = {k: v for k, v in (rerank_params or {}).items() if v is not None}
    return Spec(strategy, dataclasses.asdict(strategy_params(strategy, values)), mode, rerank,
                dataclasses.asdict(reranker_params(rerank, given)))


SIDES = ("left", "right")


def rerank_key(side: str, rerank: str, param: str) -> str:
    """The handlers' keyword name of one re-ranker parameter's control: `<side>_rerank_<name>__<param>`
    (a control per re-ranker and parameter: each has its own default and help)."""
    return f"{side}_rerank_{rerank}__{param}"


def config_from(values: dict, side: str) -> Spec:
    """One panel's configuration from the handlers' keyword values: `<side>_strategy`,
    `<side>_mode`, `<side>_<param>` for every strategy parameter, `<side>_rerank` (absent:
    "none") and the chosen re-ranker's parameters, `rerank_key(side, name, param)`."""
    params = {sp.name: values.get(f"{side}_{sp.name}") for sp in shared_params()}
    rerank = values.get(f"{side}_rerank") or NO_RERANK
    prefix = rerank_key(side, rerank, "")
    rerank_params = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
    return spec_from(values[f"{side}_strategy"], values[f"{side}_mode"], params, rerank, rerank_params)


def configs_from(values: dict) -> tuple[Spec, Spec]:
    """(left, right) from the handlers' keyword values (see `config_from`)."""
    return config_from(values, "left"), config_from(values, "right")


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


def on_rerank(rerank: str) -> list:
    """A panel's re-ranker changed → its parameter group (hidden when it takes none), then each
    re-ranker parameter control, shown only where it is the chosen re-ranker's."""
    shown = [name == rerank for name, _ in rerank_controls()]
    return [gr.update(visible=any(shown)), *(gr.update(visible=v) for v in shown)]


def on_strategy(strategy: str) -> list:
    """A panel's strategy changed → its parameter group, then each parameter control, shown
    only where the strategy takes it (the group hidden when it takes none)."""
    shown = visible_params(strategy)
    return [gr.update(visible=any(shown.values())), *(gr.update(visible=v) for v in shown.values())]


def param_control(sp: SharedParam, api: bool = False, visible: bool = True):
    """The control for one strategy parameter, from its registry metadata: a file upload,
    a slider over its bounds (where both ends are finite; the bounds validation enforces), else a
    number or text box.  `api`: a plain value."""
    label = sp.name if api else f"{sp.name}: {sp.describe()}"
    bounds = sp.metadata.get("bounds")
    if sp.metadata.get("file"):
        return gr.File(label=label, file_types=list(sp.metadata["file"]), type="filepath", visible=visible)
    if bounds is not None and bounds.finite() and not api:
        lo, hi = bounds.finite()
        return gr.Slider(lo, hi, sp.default, step=sp.metadata.get("step", (hi - lo) / 20), label=label,
                         visible=visible)
    if typing.get_origin(sp.type) is typing.Literal:  # a fixed set of values: choose, don't type
        return gr.Dropdown(list(typing.get_args(sp.type)), value=sp.default, label=label, visible=visible)
    if sp.type in (int, float):  # out-of-bounds values reach validation, which names the bounds
        return gr.Number(sp.default, precision=0 if sp.type is int else None, label=label, visible=visible)
    return gr.Textbox(sp.default, label=label, visible=visible)


def gallery_items(svc: RetrievalService, panel: Panel) -> list:
    out = []
    for r in panel.results:
        mark = "" if r["correct"] is None else ("✓ " if r["correct"] else "✗ ")
        out.append((svc.thumbnail(r["id"]), f"{mark}{r['class_name']} {r['score']:.2f}"))
    return out


def panel_title(side: str, panel: Panel, k: int) -> str:
    score = ""
    if panel.p_at_k is not None:
        ap = "n/a" if panel.ap is None else f"{panel.ap:.3f}"
        score = f" — P@{k} **{panel.p_at_k:.3f}** · AP **{ap}**"
    note = f"  \n_{panel.note}_" if panel.note else ""
    return f"### {side}: {panel.title}{score}{note}"


# Gradio hands a handler whose parameter defaults to a gr.Progress that call's progress bar (a
# no-op outside an event); one instance per handler, as a default would be
COMPARE_PROGRESS, FILTER_PROGRESS, DISAGREEMENTS_PROGRESS = gr.Progress(), gr.Progress(), gr.Progress()


def tracker(progress):
    """The comparer's progress(done, total, what) on a Gradio progress bar (a side with a re-ranker
    re-ranks every query: seconds to a minute on the demo index)."""
    if progress is None:
        return None

    def track(done: int, total: int, what: str) -> None:
        progress((done, total), desc=what, unit="queries")
    return track


class Handlers:
    """Each handler takes the two panels' configurations as keyword values (`config_from`)."""

    def __init__(self, svc: RetrievalService):
        self.svc = svc

    def _query(self, qstate, upload):
        if qstate and qstate.get("kind") == "item":
            return self.svc.query_from_item(int(qstate["id"]))
        return self.svc.query_from_upload(upload)

    def on_search(self, qstate, upload, k, **cfg):
        """→ left title, left gallery, right title, right gallery, status, results state, left and
        right heatmaps, metric report, 2-D map, share link."""
        k = int(k)
        try:
            q = self._query(qstate, upload)
            lspec, rspec = configs_from(cfg)
            left, right = self.svc.compare(q, rspec, k, left=lspec)
            known = "" if q.label is None else f" Query class: **{self.svc.class_name(q.label)}**."
            overlap = jaccard([x["id"] for x in left.results], [x["id"] for x in right.results])
            status = (f"Searched {self.svc.data.manifest['count']} gallery images.{known} Overlap of the two top "
                      f"{k} (Jaccard@{k}): {overlap:.2f}. Click a result to see why it moved.")
            ids = {"left": [x["id"] for x in left.results], "right": [x["id"] for x in right.results]}
            reports = "\n\n".join(report_md(side, s, self.svc.metric_report(s))
                                   for side, s in (("left", lspec), ("right", rspec)))
            return (panel_title("Left", left, k), gallery_items(self.svc, left),
                    panel_title("Right", right, k), gallery_items(self.svc, right), status, ids,
                    self.svc.heatmap(lspec), self.svc.heatmap(rspec), reports, self.svc.gallery_map(q),
                    share_link(q, lspec, rspec, k))
        except UserError as e:
            gr.Warning(str(e))
            return ("### Left", [], "### Right", [], f"⚠️ {e}", {"left": [], "right": []},
                    gr.update(), gr.update(), gr.update(), gr.update(), gr.update())

    def on_why(self, qstate, upload, selected, k, **cfg):
        """A result picked in either panel → the why panel's HTML (and the accordion opened)."""
        if selected is None:
            return gr.update(), gr.update()
        try:
            q = self._query(qstate, upload)
            lspec, rspec = configs_from(cfg)
            why = self.svc.why(q, int(selected), rspec, lspec, int(k))
        except UserError as e:
            gr.Warning(str(e))
            return f"<p>⚠️ {e}</p>", gr.update(open=True)
        return why_html(self.svc, why), gr.update(open=True)

    def on_export(self, qstate, upload, k, **cfg):
        """→ the JSON and CSV files of the current comparison (in a fresh temp folder)."""
        try:
            q = self._query(qstate, upload)
            lspec, rspec = configs_from(cfg)
            payload = self.svc.export(q, rspec, int(k), left=lspec)
        except UserError as e:
            gr.Warning(str(e))
            return None
        return list(write_exports(payload))

    def on_load(self, request: gr.Request):
        """A shared link's comparison → query state, query image, k, then per side (left, right) its
        strategy, mode, each parameter control, re-ranker and each re-ranker parameter control, then
        status (nothing changes for a plain URL)."""
        n = 3 + 2 * (3 + len(shared_params()) + len(rerank_controls()))
        try:
            st = parse_state(request.query_params if request is not None else {})
            if st is None:
                return (gr.update(),) * (n + 1)
            self.svc.query_from_item(st["q"])  # refuses an unknown id
        except UserError as e:
            gr.Warning(f"link: {e}")
            return (gr.update(),) * n + (f"⚠️ link: {e}",)
        sides = []
        for side in SIDES:
            c = st[side]
            sides += [c.strategy, c.mode, *(c.params.get(sp.name, gr.update()) for sp in shared_params()), c.rerank,
                      *(c.rerank_params.get(sp.name, gr.update()) if name == c.rerank else gr.update()
                        for name, sp in rerank_controls())]
        return ({"kind": "item", "id": st["q"]}, self.svc.thumbnail(st["q"], size=200), st["k"], *sides,
                f"Opened the shared comparison of gallery item {st['q']}.")

    # ------------------------------------------------------------ the Compare tab
    def _comparison(self, k, cfg, progress=None):
        lspec, rspec = configs_from(cfg)
        return self.svc.comparison(rspec, lspec, k=int(k), progress=tracker(progress))

    def on_compare(self, qstate, which, k, colour, max_jaccard, progress=COMPARE_PROGRESS, **cfg):
        """→ summary, AP scatter, disagreements table, their ids, cursor, per-class table."""
        try:
            cmp = self._comparison(k, cfg, progress)
        except UserError as e:
            gr.Warning(str(e))
            return f"⚠️ {e}", "", [], [], -1, []
        q_id = qstate.get("id") if qstate and qstate.get("kind") == "item" else None
        max_j = None if max_jaccard is None or float(max_jaccard) >= 1 else float(max_jaccard)
        dis_rows, ids = disagreement_table(cmp, which, max_j)
        summary = f"**{cmp.label_a}** (x) vs **{cmp.label_b}** (y): {cmp.summary_text()}"
        classes = [[r["class_name"], r["label"], r["n"], round(r["ap_a"], 4), round(r["ap_b"], 4), round(r["delta"], 4),
                    round(r["jaccard"], 3) if "jaccard" in r else None] for r in cmp.per_class()]
        return summary, self.svc.scatter_html(cmp, q_id, colour, max_j), dis_rows, ids, -1, classes

    def on_filter(self, which, k, max_jaccard, progress=FILTER_PROGRESS, **cfg):
        try:
            max_j = None if max_jaccard is None or float(max_jaccard) >= 1 else float(max_jaccard)
            rows, ids = disagreement_table(self._comparison(k, cfg, progress), which, max_j)
        except UserError as e:
            gr.Warning(str(e))
            return [], [], -1
        return rows, ids, -1

    def on_class(self, k, evt: gr.SelectData, **cfg):
        """A per-class table row → that class's queries (table, ids)."""
        label = int(evt.row_value[1])
        try:
            rows = self._comparison(k, cfg).class_queries(label)
        except UserError as e:
            gr.Warning(str(e))
            return [], []
        return [query_row(r) for r in rows], [r["id"] for r in rows]

    def open_item(self, item_id):
        """Open a gallery item as the query in the Search tab (→ query state, image, tab)."""
        i = int(item_id)
        return {"kind": "item", "id": i}, self.svc.thumbnail(i, size=200), gr.Tabs(selected="search")

    def on_step(self, ids, cursor, step: int):
        """Next/previous query of the filtered disagreements → query state, image, tab, cursor."""
        if not ids:
            gr.Warning("no disagreements listed: run the comparison first")
            return gr.update(), gr.update(), gr.update(), cursor
        cursor = (int(cursor) + step) % len(ids) if int(cursor) >= 0 or step > 0 else len(ids) - 1
        gr.Info(f"disagreement {cursor + 1} of {len(ids)}")
        return (*self.open_item(ids[cursor]), cursor)

    def on_maps(self, qstate, method, **cfg):
        """→ the gallery's 2-D map under the left and under the right configuration."""
        try:
            lspec, rspec = configs_from(cfg)
            q_id = qstate.get("id") if qstate and qstate.get("kind") == "item" else None
            # the metric's map: a re-ranker changes rankings, not the metric, and is not named
            return (self.svc.map_html(lspec, method, f"left: {lspec.without_rerank().label()}", q_id),
                    self.svc.map_html(rspec, method, f"right: {rspec.without_rerank().label()}", q_id))
        except UserError as e:
            gr.Warning(str(e))
            return gr.update(), gr.update()

    def on_disagreements(self, progress=DISAGREEMENTS_PROGRESS, **cfg):
        try:
            lspec, rspec = configs_from(cfg)
            rows = self.svc.disagreements(rspec, lspec, progress=tracker(progress))
        except UserError as e:
            gr.Warning(str(e))
            return [], [], f"⚠️ {e}"
        items = [(self.svc.thumbnail(x["id"]),
                  f"{x['class_name']} ΔAP {x['delta']:+.2f} ({x['ap_a']:.2f}→{x['ap_b']:.2f})")
                 for x in rows]
        msg = (f"{len(rows)} test queries with the largest AP change from {lspec.label()} to {rspec.label()}. "
               "Click one to search with it.") if rows else "The two configurations agree on every query."
        return items, [x["id"] for x in rows], msg


def share_link(q, left: Spec, right: Spec, k: int) -> str:
    """The query string of this comparison (the page's script prefixes the page address)."""
    if q.self_id is None:
        return "(an uploaded query cannot be in a link: pick a gallery image to share)"
    try:
        return state_query(q.self_id, left, right, k)
    except UserError as e:
        return f"({e})"


def query_row(r: dict) -> list:
    return [r["id"], r["class_name"], round(r["ap_a"], 4), round(r["ap_b"], 4), round(r["delta"], 4),
            round(r.get("jaccard", float("nan")), 3)]


def disagreement_table(cmp, which: str, max_jaccard: float | None = None) -> tuple[list, list]:
    rows = cmp.disagreements(which, max_jaccard=max_jaccard)
    return [query_row(r) for r in rows], [r["id"] for r in rows]


def report_md(side: str, spec: Spec, rep: dict) -> str:
    return (f"**{side}: M = {spec.without_rerank().label()}**  \n"
            f"tr(M) = {rep['trace']:.4g} · ‖M‖_F = {rep['frobenius']:.4g} · "
            f"‖M_off‖_F = {rep['offdiag_frobenius']:.4g}  \n"
            f"principle 1 tr/‖·‖_F = {rep['trace_over_frobenius']:.4g} · principle 2 ‖·‖_F/tr = "
            f"{rep['frobenius_over_trace']:.4g}  \n"
            f"{'PSD' if rep['psd'] else 'indefinite'} (min eigenvalue {rep['min_eigenvalue']:.3g}), rank {rep['rank']}")


def api_search(svc: RetrievalService):
    # the API's parameters: image, strategy, then each file-free strategy parameter, mode, k, and
    # (optional, after every earlier one: old positional calls keep working) rerank, rerank_params
    def search(image, strategy="trained", *, mode="cosine", k=10, rerank=NO_RERANK, rerank_params="",
               **params) -> dict:
        """Search the gallery with an image under a metric (and a re-ranker); returns the ranked results."""
        try:
            spec = spec_from(strategy, mode, params, rerank or NO_RERANK, rerank_params_from(rerank_params))
            q = svc.query_from_upload(image)
            panel = svc.panel(q, spec, int(k))
        except UserError as e:
            raise gr.Error(str(e)) from None
        # "relative_path", not "path": gradio_client would take a "path" key for a file to download
        return {"metric": panel.title, "note": panel.note,
                "results": [{f: x[f] for f in RESULT_FIELDS} for x in panel.results]}
    return search


def offline_theme():
    # system fonts only: the default theme would fetch Google Fonts from the browser
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


CSS = (".result-gallery .caption-label {font-size: 13px;}\n"
       ".cmp-plot circle {cursor: pointer;} .cmp-plot circle:hover {stroke: black; stroke-width: 1.5;}")
QUERY_COLUMNS = ("id", "class", "AP left", "AP right", "ΔAP", "Jaccard@k")
CLASS_COLUMNS = ("class", "label", "n", "AP left", "AP right", "Δ", "mean Jaccard@k")
K_DEFAULT = 12  # results per panel shown at first

# The page's scripts, kept as JavaScript files beside this module (Gradio takes them as source text):
STATIC = Path(__file__).resolve().parent / "static"
# plot.js: a click on a point (any element with data-id) → the component's "click" event with {id};
# hovering shows the point's tooltip with its thumbnail, fetched through a server function
PLOT_JS = (STATIC / "plot.js").read_text()
# link.js: the share box shows a whole address, this page's with the comparison's query string
LINK_JS = (STATIC / "link.js").read_text().strip()
# keys.js: n / p step to the next / previous disagreement, unless the user is typing in a field
KEYS_JS = (STATIC / "keys.js").read_text()


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


def config_controls(svc: RetrievalService, side: str, spec: Spec) -> ConfigControls:
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


@dataclasses.dataclass
class Shared:
    """The components every tab reads or writes: the query, the two configurations, k, the tab switch."""
    qstate: gr.State
    query: gr.Image
    left: ConfigControls
    right: ConfigControls
    k: gr.Slider
    tabs: gr.Tabs
    status: gr.Markdown

    @property
    def configs(self) -> dict:
        """Both panels' configuration controls, as the handlers' keyword inputs."""
        return self.left.kwargs | self.right.kwargs

    @property
    def opened(self) -> list:
        """What opening a gallery item as the query sets: its state, its image, the Search tab."""
        return [self.qstate, self.query, self.tabs]


def header_md(svc: RetrievalService, name: str | None, others) -> str:
    man = svc.data.manifest
    trace = float(np.square(svc.data.W.astype(np.float64)).sum())  # tr(WᵀW) = ‖W‖²_F: how far the neck moved
    text = (f"## Metric refinement explorer{f': {name}' if name else ''}\n"
            f"Gallery: **{man['count']}** images of **{man['classes']}** "
            f"classes ({man.get('dataset', '?')} {man.get('split', '')}), backbone "
            f"`{man.get('backbone')}`, trunk d = {man['trunk_dim']}, embedding k = {man['embed_dim']}, "
            f"tr(M*) = {trace:.4g}. Each panel ranks under a configuration you choose (a refinement strategy, "
            "its parameters, a mode): at first the **trained** metric M* = WᵀW on the left, the identity on the right.")
    if others:
        text += f"  \nThis app serves another index too: {index_links(others)}."
    return text


def index_links(others) -> str:
    """Links to the other indexes this process serves, each (name, address)."""
    return " · ".join(f"[{name}]({url})" for name, url in others)


def search_tab(svc: RetrievalService, tabs: gr.Tabs) -> tuple[Shared, dict]:
    """The Search tab: query, each panel's configuration and results, the why panel, share/export,
    examples, disagreements.  Returns the shared components and this tab's own (wired by `wire_search`)."""
    from app.compare_view import K_RANGE

    example_ids = svc.examples()
    qstate = gr.State(None)
    results_state = gr.State({"left": [], "right": []})
    selected, dis_ids = gr.State(None), gr.State([])
    with gr.Row():
        with gr.Column(scale=1, min_width=260):
            query = UploadImage(label="Query: upload or paste an image", type="filepath",
                                sources=["upload", "clipboard"], height=200)
            k = gr.Slider(*K_RANGE, K_DEFAULT, step=1, label="k")
            go = gr.Button("Search", variant="primary")
            status = gr.Markdown("Pick an example below or upload an image.")
        with gr.Column(scale=4):
            with gr.Row():
                with gr.Column():
                    left_cfg = config_controls(svc, "left", SearchConfig())
                    left_title = gr.Markdown("### Left: trained")
                    left = gr.Gallery(columns=4, height=430, allow_preview=False, elem_classes="result-gallery",
                                      object_fit="contain", label="left", elem_id="left-results")
                with gr.Column():
                    right_cfg = config_controls(svc, "right", DEFAULT_RIGHT)
                    right_title = gr.Markdown("### Right: identity")
                    right = gr.Gallery(columns=4, height=430, allow_preview=False, elem_classes="result-gallery",
                                       object_fit="contain", label="right", elem_id="right-results")
            with gr.Accordion("Why did this result move? Click a result in either panel", open=False,
                              elem_id="why-accordion") as why_box:
                why = gr.HTML("<p>Click a result in either panel: its rank and score under both configurations, "
                              "and which directions of the metrics' difference moved it.</p>", elem_id="why")
            follow = gr.Button("Search with the selected result")
            with gr.Row():
                link = gr.Textbox(label="Link to this comparison", buttons=["copy"], interactive=False,
                                  scale=3, elem_id="share-link")
                export = gr.Button("Export JSON + CSV", scale=1)
            gr.Markdown("_An uploaded query cannot be in a link: share a gallery query (an example, a "
                        "result, a disagreement)._")
            link_qs = gr.Textbox(visible=False)
            exported = gr.File(label="exported comparison", file_count="multiple", visible=True, height=80)
    examples = gr.Gallery(value=[(svc.thumbnail(i), svc.class_name(svc.query_from_item(i).label))
                                 for i in example_ids],
                          label="Examples from the test split: click one to query", columns=12,
                          height=200, allow_preview=False, object_fit="contain")
    with gr.Accordion("Disagreements: test queries where the two configurations differ most", open=False):
        dis_go = gr.Button("Find disagreements for the current configurations")
        dis_msg = gr.Markdown()
        dis = gr.Gallery(columns=6, height=300, allow_preview=False, label="largest |ΔAP|", object_fit="contain")
    sh = Shared(qstate, query, left_cfg, right_cfg, k, tabs, status)
    own = dict(example_ids=example_ids, results_state=results_state, selected=selected, dis_ids=dis_ids, go=go,
               left_title=left_title, left=left, right_title=right_title, right=right, follow=follow, link=link,
               export=export, link_qs=link_qs, exported=exported, examples=examples, dis_go=dis_go,
               dis_msg=dis_msg, dis=dis, why=why, why_box=why_box)
    return sh, own


def wire_search(svc: RetrievalService, h: Handlers, sh: Shared, t: dict, analysis: tuple, demo: gr.Blocks):
    """The Search tab's events, once every tab exists (a search also updates the Analysis tab's
    `analysis` components).  Returns `search_on`: chains a search after any event."""
    qstate, query, k, status = sh.qstate, sh.query, sh.k, sh.status
    example_ids, results_state, selected, dis_ids, link_qs = (t["example_ids"], t["results_state"], t["selected"],
                                                              t["dis_ids"], t["link_qs"])
    left, right = t["left"], t["right"]
    outputs = [t["left_title"], left, t["right_title"], right, status, results_state, *analysis, link_qs]

    def search_on(event):
        return event(h.on_search, [qstate, query, k], outputs, inputs_kwargs=sh.configs, api_visibility="private")

    search_on(t["go"].click)
    search_on(query.upload(lambda: {"kind": "upload"}, None, qstate, api_visibility="private").then)
    for cc in (sh.left, sh.right):
        # a strategy shows its own parameters only (then searches, as every control's change does)
        cc.strategy.change(on_strategy, cc.strategy, [cc.group, *cc.controls.values()], api_visibility="private")
        # a re-ranker likewise
        cc.rerank.change(on_rerank, cc.rerank, [cc.rerank_group, *cc.rerank_controls.values()],
                         api_visibility="private")
        for ctl in (cc.strategy, cc.mode, *cc.controls.values(), cc.rerank, *cc.rerank_controls.values()):
            # sliders search when let go, boxes on enter, the rest on any change
            search_on(ctl.release if isinstance(ctl, gr.Slider) else
                      ctl.submit if isinstance(ctl, (gr.Number, gr.Textbox)) else ctl.change)
    search_on(k.release)

    def pick_example(evt: gr.SelectData):
        i = example_ids[evt.index]
        return {"kind": "item", "id": i}, svc.thumbnail(i, size=200)

    search_on(t["examples"].select(pick_example, None, [qstate, query], api_visibility="private").then)

    def pick_result(side):
        def f(ids, evt: gr.SelectData):
            lst = ids.get(side, [])
            return lst[evt.index] if evt.index < len(lst) else None
        return f

    for side, gallery in (("left", left), ("right", right)):
        gallery.select(pick_result(side), results_state, selected, api_visibility="private").then(
            h.on_why, [qstate, query, selected, k], [t["why"], t["why_box"]], inputs_kwargs=sh.configs,
            api_visibility="private")

    def follow_up(sel):
        if sel is None:
            gr.Warning("click a result first")
            return gr.update(), gr.update()
        return {"kind": "item", "id": int(sel)}, svc.thumbnail(int(sel), size=200)

    search_on(t["follow"].click(follow_up, selected, [qstate, query], api_visibility="private").then)
    t["dis_go"].click(h.on_disagreements, None, [t["dis"], dis_ids, t["dis_msg"]], inputs_kwargs=sh.configs,
                      api_visibility="private")

    def pick_dis(ids, evt: gr.SelectData):
        i = ids[evt.index]
        return {"kind": "item", "id": i}, svc.thumbnail(i, size=200)

    search_on(t["dis"].select(pick_dis, dis_ids, [qstate, query], api_visibility="private").then)
    link_qs.change(None, link_qs, t["link"], js=LINK_JS)
    t["export"].click(h.on_export, [qstate, query, k], t["exported"], inputs_kwargs=sh.configs,
                      api_visibility="private")
    search_on(demo.load(h.on_load, None, [qstate, query, k, *sh.left.components, *sh.right.components, status],
                        api_visibility="private").then)
    return search_on


def compare_tab(svc: RetrievalService) -> dict:
    """The Compare tab: every test query under the left configuration against the right one."""
    from index.analysis.compare import FILTERS

    cmp_ids, cmp_cursor, class_q_ids = gr.State([]), gr.State(-1), gr.State([])
    gr.Markdown("### Every test query: the left configuration (x) against the right one (y)\n"
                "Both configurations and k are the Search tab's. Click a point, a disagreement or a "
                "class's query to open it in the Search tab; keys **n** / **p** step through the "
                "filtered disagreements. Jaccard@k: how much a query's two top-k lists overlap (1: the same items).")
    cmp_go = gr.Button("Compare on every test query", variant="primary")
    cmp_summary = gr.Markdown()
    with gr.Row():
        scatter = plot_html(svc, "cmp-scatter")
        with gr.Column():
            with gr.Row():
                colour = gr.Radio([("ΔAP: improved / worsened", "outcome"), ("Jaccard@k", "jaccard")],
                                  value=SCATTER_COLOURS[0], label="colour points by", elem_id="cmp-colour")
                max_jaccard = gr.Slider(0, 1, 1, step=0.05, label="only queries with Jaccard@k at most",
                                        elem_id="cmp-max-jaccard")
            which = gr.Radio(list(FILTERS), value="all", label="Disagreements (by |ΔAP|)")
            with gr.Row():
                prev_btn = gr.Button("◀ previous (p)", elem_id="cmp-prev", size="sm")
                next_btn = gr.Button("next (n) ▶", elem_id="cmp-next", size="sm")
            dis_table = gr.Dataframe(headers=list(QUERY_COLUMNS), interactive=False, max_height=380,
                                     label="click a row to open it")
    with gr.Row():
        class_table = gr.Dataframe(headers=list(CLASS_COLUMNS), interactive=False, max_height=360,
                                   label="per class (sort by a header; click a class for its queries)")
        class_queries = gr.Dataframe(headers=list(QUERY_COLUMNS), interactive=False, max_height=360,
                                     label="the class's queries")
    with gr.Accordion("2-D maps of the gallery under the left and the right metric (computed once per metric)",
                      open=False):
        with gr.Row():
            method = gr.Radio(list(MAP_METHODS), value="t-SNE", label="projection")
            maps_go = gr.Button("Draw the maps")
        with gr.Row():
            map_a, map_b = plot_html(svc, "map-a"), plot_html(svc, "map-b")
    return dict(cmp_ids=cmp_ids, cmp_cursor=cmp_cursor, class_q_ids=class_q_ids, cmp_go=cmp_go,
                cmp_summary=cmp_summary, scatter=scatter, which=which, prev_btn=prev_btn, next_btn=next_btn,
                dis_table=dis_table, class_table=class_table, class_queries=class_queries, method=method,
                maps_go=maps_go, map_a=map_a, map_b=map_b, colour=colour, max_jaccard=max_jaccard)


def wire_compare(h: Handlers, sh: Shared, c: dict, cmp_tab, search_on) -> None:
    cfg = sh.configs
    cmp_out = [c["cmp_summary"], c["scatter"], c["dis_table"], c["cmp_ids"], c["cmp_cursor"], c["class_table"]]
    for ev in (c["cmp_go"].click, cmp_tab.select, c["colour"].change, c["max_jaccard"].release):
        ev(h.on_compare, [sh.qstate, c["which"], sh.k, c["colour"], c["max_jaccard"]], cmp_out, inputs_kwargs=cfg,
           api_visibility="private")
    c["which"].change(h.on_filter, [c["which"], sh.k, c["max_jaccard"]], [c["dis_table"], c["cmp_ids"],
                                                                         c["cmp_cursor"]],
                      inputs_kwargs=cfg, api_visibility="private")

    def open_clicked(evt: PointClick):
        return h.open_item(evt.id)

    def open_row(evt: gr.SelectData):
        return h.open_item(evt.row_value[0])

    for plot in (c["scatter"], c["map_a"], c["map_b"]):
        search_on(plot.click(open_clicked, None, sh.opened, api_visibility="private").then)
    for table in (c["dis_table"], c["class_queries"]):
        search_on(table.select(open_row, None, sh.opened, api_visibility="private").then)
    for btn, step in ((c["next_btn"], 1), (c["prev_btn"], -1)):
        search_on(btn.click(lambda ids, cur, s=step: h.on_step(ids, cur, s), [c["cmp_ids"], c["cmp_cursor"]],
                            [*sh.opened, c["cmp_cursor"]], api_visibility="private").then)
    c["class_table"].select(h.on_class, [sh.k], [c["class_queries"], c["class_q_ids"]], inputs_kwargs=cfg,
                            api_visibility="private")
    c["maps_go"].click(h.on_maps, [sh.qstate, c["method"]], [c["map_a"], c["map_b"]], inputs_kwargs=cfg,
                       api_visibility="private")


def analysis_tab(svc: RetrievalService):
    """The Analysis tab: `index evaluate`'s table and figures, both panels' metrics, the gallery map.
    Returns the components a search updates: the left and right heatmaps, their reports, the gallery map."""
    a = svc.analysis()
    gr.Markdown("### Strategy evaluation on the test classes (`python -m index evaluate`)")
    gr.Markdown(a["table"] or "_No evaluation found: run `python -m index evaluate`._")
    # captions above the figures: an image's label would cover its title
    with gr.Row():
        for img, caption in ((a["sweep"], "accuracy vs restraint degree r"),
                             (a["principles"], "accuracy vs principle ratios")):
            with gr.Column():
                gr.Markdown(f"**{caption}**")
                gr.Image(img, show_label=False, interactive=False)
    with gr.Row():
        with gr.Column():
            gr.Markdown("**left panel's metric** (at first M*, trained)")
            m_left = gr.Image(svc.heatmap(Spec("trained", {}, "cosine")), show_label=False, interactive=False)
        with gr.Column():
            gr.Markdown("**right panel's metric**")
            m_right = gr.Image(show_label=False, interactive=False)
        with gr.Column():
            gr.Markdown("**2-D map of the gallery**")
            gal_map = gr.Image(svc.gallery_map(), show_label=False, interactive=False)
    m_report = gr.Markdown()
    return m_left, m_right, m_report, gal_map


def api_endpoint(svc: RetrievalService) -> None:
    """The HTTP API `/search` (gradio_client, see the README): hidden components give it typed,
    file-uploading parameters; the UI never shows them.  Strategies needing a file are left out.
    A re-ranker (`rerank`, its parameters as `rerank_params`) comes last, defaulting to none."""
    with gr.Row(visible=False):
        a_img = UploadImage(type="filepath", label="image")
        a_strategy = gr.Dropdown(svc.strategy_choices(with_files=False), value="trained", label="strategy")
        a_params = {sp.name: param_control(sp, api=True) for sp in shared_params() if not sp.metadata.get("file")}
        a_mode = gr.Dropdown(list(MODES), value="cosine", label="mode")  # the CLI's defaults
        a_k = gr.Number(10, precision=0, label="k")
        a_rerank = gr.Dropdown(RERANKERS.names(), value=NO_RERANK, label="rerank")
        a_rerank_params = gr.Textbox("", label="rerank_params")  # "n=3, alpha=1" or a JSON object
        a_out = gr.JSON(label="results")
        a_btn = gr.Button()
    last = {"mode": a_mode, "k": a_k, "rerank": a_rerank, "rerank_params": a_rerank_params}
    a_btn.click(api_search(svc), [a_img, a_strategy], a_out, inputs_kwargs=a_params | last, api_name="search")


def build_ui(svc: RetrievalService, name: str | None = None, others=()) -> gr.Blocks:
    """`name`: this index's name in the header; `others`: (name, address) of the indexes served beside it."""
    h = Handlers(svc)
    with gr.Blocks(title="Metric refinement explorer") as demo:
        gr.Markdown(header_md(svc, name, others), elem_id="index-header")
        with gr.Tabs() as tabs:
            with gr.Tab("Search", id="search"):
                sh, search_parts = search_tab(svc, tabs)
            with gr.Tab("Compare", id="compare") as cmp_tab:
                cmp_parts = compare_tab(svc)
            with gr.Tab("Analysis"):
                analysis = analysis_tab(svc)
        search_on = wire_search(svc, h, sh, search_parts, analysis, demo)
        wire_compare(h, sh, cmp_parts, cmp_tab, search_on)
        api_endpoint(svc)
    return demo
