"""The Gradio Blocks UI.  Handlers are thin: they call RetrievalService and turn
UserErrors into a visible message, so a bad upload never stops the app."""
from __future__ import annotations

import dataclasses
import logging
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from core.errors import UserError  # noqa: E402
from index.refinements import MODES, REFINEMENTS, SharedParam, file_params, shared_params, strategy_params  # noqa: E402
from index.search import RESULT_FIELDS  # noqa: E402

from .service import Panel, RetrievalService, Spec  # noqa: E402

log = logging.getLogger("app")


class UploadImage(gr.Image):
    """gr.Image that hands us the uploaded file untouched: our own loader decodes it
    (all modes, EXIF, bomb limit) and reports a broken file clearly, instead of
    Gradio's preprocessing failing with a generic error."""

    def get_block_name(self) -> str:
        return "image"

    def preprocess(self, payload):
        if payload is not None and getattr(payload, "path", None):
            return str(payload.path)
        return super().preprocess(payload)


def spec_from(strategy, mode, values: dict) -> Spec:
    """A Spec from the parameter controls' values (every strategy's, by name): the chosen
    strategy's typed parameters, so that its label shows exactly what was searched."""
    for name in file_params(strategy):
        if not values.get(name):
            raise UserError(f"strategy {strategy}: upload {REFINEMENTS.get(strategy).param_help()[name]} first")
    return Spec(strategy, dataclasses.asdict(strategy_params(strategy, values)), mode)


def param_control(sp: SharedParam, api: bool = False):
    """The control for one strategy parameter, from its registry metadata: a file upload,
    a slider (where it declares a range), else a number or text box.  `api`: a plain value."""
    label = sp.name if api else f"{sp.name}: {sp.describe()}"
    if sp.metadata.get("file"):
        return gr.File(label=label, file_types=list(sp.metadata["file"]), type="filepath")
    if "range" in sp.metadata and not api:
        lo, hi = sp.metadata["range"]
        return gr.Slider(lo, hi, sp.default, step=sp.metadata.get("step", (hi - lo) / 20), label=label)
    if sp.type in (int, float):
        return gr.Number(sp.default, precision=0 if sp.type is int else None, label=label)
    return gr.Textbox(sp.default, label=label)


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


class Handlers:
    def __init__(self, svc: RetrievalService):
        self.svc = svc

    def _query(self, qstate, upload):
        if qstate and qstate.get("kind") == "item":
            return self.svc.query_from_item(int(qstate["id"]))
        return self.svc.query_from_upload(upload)

    def on_search(self, qstate, upload, strategy, mode, k, **params):
        """→ left title, left gallery, right title, right gallery, status, results state, M′ heatmap,
        M′ report, 2-D map.  `params`: every strategy parameter control's value, by name."""
        k = int(k)
        try:
            q = self._query(qstate, upload)
            spec = spec_from(strategy, mode, params)
            left, right = self.svc.compare(q, spec, k, left_mode=mode if mode == "cosine" else "bilinear")
            rep = self.svc.metric_report(spec)
            known = "" if q.label is None else f" Query class: **{self.svc.class_name(q.label)}**."
            status = f"Searched {self.svc.data.manifest['count']} gallery images.{known}"
            ids = {"left": [x["id"] for x in left.results], "right": [x["id"] for x in right.results]}
            return (panel_title("Left", left, k), gallery_items(self.svc, left),
                    panel_title("Right", right, k), gallery_items(self.svc, right), status, ids,
                    self.svc.heatmap(spec), report_md(spec, rep), self.svc.gallery_map(q))
        except UserError as e:
            gr.Warning(str(e))
            return ("### Left", [], "### Right", [], f"⚠️ {e}", {"left": [], "right": []},
                    gr.update(), gr.update(), gr.update())

    def on_disagreements(self, strategy, mode, **params):
        try:
            spec = spec_from(strategy, mode, params)
            rows = self.svc.disagreements(spec, left_mode=mode if mode == "cosine" else "bilinear")
        except UserError as e:
            gr.Warning(str(e))
            return [], [], f"⚠️ {e}"
        items = [(self.svc.thumbnail(x["id"]),
                  f"{x['class_name']} ΔAP {x['delta']:+.2f} ({x['ap_trained']:.2f}→{x['ap_refined']:.2f})")
                 for x in rows]
        msg = (f"{len(rows)} test queries with the largest AP change from trained to {spec.label()}. "
               "Click one to search with it.") if rows else "The two metrics agree on every query."
        return items, [x["id"] for x in rows], msg


def report_md(spec: Spec, rep: dict) -> str:
    return (f"**M′ = {spec.label()}**  \n"
            f"tr(M′) = {rep['trace']:.4g} · ‖M′‖_F = {rep['frobenius']:.4g} · ‖M′_off‖_F = {rep['offdiag_frobenius']:.4g}  \n"
            f"principle 1 tr/‖·‖_F = {rep['trace_over_frobenius']:.4g} · principle 2 ‖·‖_F/tr = "
            f"{rep['frobenius_over_trace']:.4g}  \n"
            f"{'PSD' if rep['psd'] else 'indefinite'} (min eigenvalue {rep['min_eigenvalue']:.3g}), rank {rep['rank']}")


def api_search(svc: RetrievalService):
    # the API's parameters: image, strategy, then each file-free strategy parameter, mode, k
    def search(image, strategy="trained", *, mode="cosine", k=10, **params) -> dict:
        """Search the gallery with an image under a metric; returns the ranked results."""
        try:
            q = svc.query_from_upload(image)
            panel = svc.panel(q, spec_from(strategy, mode, params), int(k))
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


CSS = ".result-gallery .caption-label {font-size: 13px;}"


def build_ui(svc: RetrievalService) -> gr.Blocks:
    h = Handlers(svc)
    man = svc.data.manifest
    example_ids = svc.examples()
    with gr.Blocks(title="Metric refinement explorer") as demo:
        gr.Markdown(f"## Metric refinement explorer\nGallery: **{man['count']}** images of **{man['classes']}** "
                    f"classes ({man.get('dataset', '?')} {man.get('split', '')}), backbone "
                    f"`{man.get('backbone')}`, trunk d = {man['trunk_dim']}, embedding k = {man['embed_dim']}. "
                    "Left: the **trained** metric M* = WᵀW; right: the metric you choose.")
        qstate = gr.State(None)
        results_state = gr.State({"left": [], "right": []})
        selected = gr.State(None)
        dis_ids = gr.State([])
        with gr.Tab("Search"):
            with gr.Row():
                with gr.Column(scale=1, min_width=280):
                    query = UploadImage(label="Query: upload or paste an image", type="filepath",
                                        sources=["upload", "clipboard"], height=200)
                    strategy = gr.Dropdown(svc.strategy_choices(), value="identity", label="Right-panel strategy")
                    mode = gr.Radio(["cosine", "bilinear"], value="cosine", label="Mode (both panels)")
                    with gr.Accordion("Strategy parameters", open=True):
                        controls = {sp.name: param_control(sp) for sp in shared_params()}
                    k = gr.Slider(1, 48, 12, step=1, label="k")
                    go = gr.Button("Search", variant="primary")
                    status = gr.Markdown("Pick an example below or upload an image.")
                with gr.Column(scale=3):
                    with gr.Row():
                        with gr.Column():
                            left_title = gr.Markdown("### Left: trained")
                            left = gr.Gallery(columns=4, height=430, allow_preview=False, elem_classes="result-gallery", object_fit="contain",
                                              label="trained M*")
                        with gr.Column():
                            right_title = gr.Markdown("### Right: refined")
                            right = gr.Gallery(columns=4, height=430, allow_preview=False, elem_classes="result-gallery", object_fit="contain",
                                               label="refined M′")
                    follow = gr.Button("Search with the selected result")
            examples = gr.Gallery(value=[(svc.thumbnail(i), svc.class_name(svc.query_from_item(i).label))
                                         for i in example_ids],
                                  label="Examples from the test split: click one to query", columns=12,
                                  height=200, allow_preview=False, object_fit="contain")
            with gr.Accordion("Disagreements: test queries where the two metrics differ most", open=False):
                dis_go = gr.Button("Find disagreements for the current strategy")
                dis_msg = gr.Markdown()
                dis = gr.Gallery(columns=6, height=300, allow_preview=False, label="largest |ΔAP|",
                                 object_fit="contain")
        with gr.Tab("Analysis"):
            a = svc.analysis()
            gr.Markdown("### Strategy evaluation on the test classes (`python -m index evaluate`)")
            gr.Markdown(a["table"] or "_No evaluation found: run `python -m index evaluate`._")
            with gr.Row():
                gr.Image(a["sweep"], label="accuracy vs restraint degree r", interactive=False)
                gr.Image(a["principles"], label="accuracy vs principle ratios", interactive=False)
            with gr.Row():
                gr.Image(svc.heatmap(Spec("trained", {}, "bilinear")), label="M* (trained)", interactive=False)
                m_prime = gr.Image(label="current M′", interactive=False)
                gal_map = gr.Image(svc.gallery_map(), label="2-D map of the gallery", interactive=False)
            m_report = gr.Markdown()

        inputs = [qstate, query, strategy, mode, k]
        outputs = [left_title, left, right_title, right, status, results_state, m_prime, m_report, gal_map]

        def search_on(event):
            return event(h.on_search, inputs, outputs, inputs_kwargs=controls, api_visibility="private")

        search_on(go.click)
        search_on(query.upload(lambda: {"kind": "upload"}, None, qstate, api_visibility="private").then)
        for ctl in (strategy, mode, *controls.values(), k):
            # sliders search when let go, boxes on enter, the rest on any change
            search_on(ctl.release if isinstance(ctl, gr.Slider) else
                      ctl.submit if isinstance(ctl, (gr.Number, gr.Textbox)) else ctl.change)

        def pick_example(evt: gr.SelectData):
            i = example_ids[evt.index]
            return {"kind": "item", "id": i}, svc.thumbnail(i, size=200)

        search_on(examples.select(pick_example, None, [qstate, query], api_visibility="private").then)

        def pick_result(side):
            def f(ids, evt: gr.SelectData):
                lst = ids.get(side, [])
                return lst[evt.index] if evt.index < len(lst) else None
            return f

        left.select(pick_result("left"), results_state, selected, api_visibility="private")
        right.select(pick_result("right"), results_state, selected, api_visibility="private")

        def follow_up(sel):
            if sel is None:
                gr.Warning("click a result first")
                return gr.update(), gr.update()
            return {"kind": "item", "id": int(sel)}, svc.thumbnail(int(sel), size=200)

        search_on(follow.click(follow_up, selected, [qstate, query], api_visibility="private").then)

        dis_go.click(h.on_disagreements, [strategy, mode], [dis, dis_ids, dis_msg], inputs_kwargs=controls,
                     api_visibility="private")

        def pick_dis(ids, evt: gr.SelectData):
            i = ids[evt.index]
            return {"kind": "item", "id": i}, svc.thumbnail(i, size=200)

        search_on(dis.select(pick_dis, dis_ids, [qstate, query], api_visibility="private").then)

        # The HTTP API `/search` (gradio_client, see README): hidden components give it typed,
        # file-uploading parameters; the UI never shows them.  Strategies needing a file are left out.
        with gr.Row(visible=False):
            a_img = UploadImage(type="filepath", label="image")
            a_strategy = gr.Dropdown(svc.strategy_choices(with_files=False), value="trained", label="strategy")
            a_params = {sp.name: param_control(sp, api=True) for sp in shared_params() if not sp.metadata.get("file")}
            a_mode = gr.Dropdown(list(MODES), value="cosine", label="mode")  # the CLI's defaults
            a_k = gr.Number(10, precision=0, label="k")
            a_out = gr.JSON(label="results")
            a_btn = gr.Button()
        a_btn.click(api_search(svc), [a_img, a_strategy], a_out, inputs_kwargs=a_params | {"mode": a_mode, "k": a_k},
                    api_name="search")
    return demo
