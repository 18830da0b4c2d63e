"""The app's layout: the Gradio Blocks page (Search, Compare and Analysis tabs, the /search API)
placing the controls (app/controls.py) and wiring their events to the handlers
(app/handlers.py)."""
from __future__ import annotations

import dataclasses

import gradio as gr
import numpy as np

from index.search_config import SearchConfig

from .compare_view import K_RANGE, MAP_METHODS, SCATTER_COLOURS
from .controls import (
    STATIC,
    ConfigControls,
    PointClick,
    UploadImage,
    api_controls,
    config_controls,
    plot_html,
)
from .handlers import CLASS_COLUMNS, QUERY_COLUMNS, Handlers, api_search, on_rerank, on_strategy
from .params import DEFAULT_RIGHT
from .service import RetrievalService


def offline_theme():
    # system fonts only: the default theme would fetch Google Fonts from the browser
    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


CSS = (".result-gallery .caption-label {font-size: 13px;}\n"
       ".cmp-plot circle {cursor: pointer;} .cmp-plot circle:hover {stroke: black; stroke-width: 1.5;}")
K_DEFAULT = 12  # results per panel shown at first
# link.js: the share box shows a whole address, this page's with the comparison's query string
LINK_JS = (STATIC / "link.js").read_text().strip()
# keys.js: n / p step to the next / previous disagreement, unless the user is typing in a field
KEYS_JS = (STATIC / "keys.js").read_text()


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


BACKEND_NAMES = {"faiss": "the index directory's FAISS index, in RAM", "ondisk": "an on-disk IVF",
                 "milvus": "a Milvus collection"}


def header_md(svc: RetrievalService, name: str | None, others) -> str:
    man = svc.data.manifest
    trace = float(np.square(svc.data.W.astype(np.float64)).sum())  # tr(WᵀW) = ‖W‖²_F: how far the neck moved
    classes = svc.class_count()
    text = (f"## Metric refinement explorer{f': {name}' if name else ''}\n"
            f"Gallery: **{len(svc.data.items):,}** items of **{'?' if classes is None else f'{classes:,}'}** "
            f"classes ({man.get('dataset', '?')} {man.get('split', '')}), backbone "
            f"`{man.get('backbone')}`, trunk d = {svc.data.W.shape[1]}, embedding k = {svc.data.W.shape[0]}, "
            f"searched in {BACKEND_NAMES[svc.backend]}, "
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
            # hidden until there is an export (`Handlers.on_export` shows it): empty, it takes room
            exported = gr.File(label="exported comparison", file_count="multiple", visible=False, height=80,
                               elem_id="exported")
    examples = gr.Gallery(value=[(svc.thumbnail(i), svc.item_class(i))
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

    def search_on(event, refresh: bool = False):
        """A search after `event`; `refresh`: one that a load or a control's change starts, silent
        while no query has been chosen."""
        return event(h.on_refresh if refresh else h.on_search, [qstate, query, k], outputs,
                     inputs_kwargs=sh.configs, api_visibility="private")

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
                      ctl.submit if isinstance(ctl, (gr.Number, gr.Textbox)) else ctl.change, refresh=True)
    search_on(k.release, refresh=True)

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
                        api_visibility="private").then, refresh=True)
    return search_on


def compare_tab(svc: RetrievalService) -> dict:
    """The Compare tab: every test query under the left configuration against the right one."""
    from index.analysis.compare import FILTERS

    cmp_ids, cmp_cursor, class_q_ids = gr.State([]), gr.State(-1), gr.State([])
    which_queries = "A seeded sample of the test queries" if svc.sampled() else "Every test query"
    gr.Markdown(f"### {which_queries}: the left configuration (x) against the right one (y)\n"
                "Both configurations and k are the Search tab's. Click a point, a disagreement or a "
                "class's query to open it in the Search tab; keys **n** / **p** step through the "
                "filtered disagreements. Jaccard@k: how much a query's two top-k lists overlap (1: the same items).")
    if svc.sampled():
        gr.Markdown(f"_This gallery has more than {svc.compare_all_up_to:,} items: the comparison reads a random "
                    "sample of the queries, drawn with the seed below; its size and each figure's bootstrap 95% "
                    "interval are shown with it._")
    with gr.Row():
        cmp_go = gr.Button("Compare on a sample of the test queries" if svc.sampled() else
                           "Compare on every test query", variant="primary", scale=3)
        seed = gr.Number(0, precision=0, label="sample seed", visible=svc.sampled(), scale=1, elem_id="cmp-seed")
        sample = gr.Number(svc.compare_sample, precision=0, label="sample size (queries)", visible=svc.sampled(),
                           minimum=1, scale=1, elem_id="cmp-sample")
    cmp_summary = gr.Markdown(elem_id="cmp-summary")
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
                maps_go=maps_go, map_a=map_a, map_b=map_b, colour=colour, max_jaccard=max_jaccard, seed=seed,
                sample=sample)


def wire_compare(h: Handlers, sh: Shared, c: dict, cmp_tab, search_on) -> None:
    cfg = sh.configs
    cmp_out = [c["cmp_summary"], c["scatter"], c["dis_table"], c["cmp_ids"], c["cmp_cursor"], c["class_table"]]
    for ev in (c["cmp_go"].click, cmp_tab.select, c["colour"].change, c["max_jaccard"].release):
        ev(h.on_compare, [sh.qstate, c["which"], sh.k, c["colour"], c["max_jaccard"], c["seed"], c["sample"]],
           cmp_out, inputs_kwargs=cfg, api_visibility="private")
    c["which"].change(h.on_filter, [c["which"], sh.k, c["max_jaccard"], c["seed"], c["sample"]],
                      [c["dis_table"], c["cmp_ids"], c["cmp_cursor"]],
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
    c["class_table"].select(h.on_class, [sh.k, c["seed"], c["sample"]], [c["class_queries"], c["class_q_ids"]],
                            inputs_kwargs=cfg,
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
            m_left = gr.Image(svc.heatmap(SearchConfig("trained", {}, "cosine")), show_label=False, interactive=False)
        with gr.Column():
            gr.Markdown("**right panel's metric**")
            m_right = gr.Image(show_label=False, interactive=False)
        with gr.Column():
            gr.Markdown("**2-D map of the gallery**")
            gal_map = gr.Image(svc.gallery_map(), show_label=False, interactive=False)
    m_report = gr.Markdown()
    return m_left, m_right, m_report, gal_map


def api_endpoint(svc: RetrievalService) -> None:
    """The HTTP API `/search` (gradio_client, docs/app-and-compare.md): hidden components give it
    typed, file-uploading parameters in the API's stable order (`service.api_params()`: a new one
    only ever comes last, so positional calls keep working); the UI never shows them.  Strategies
    needing a file are left out."""
    with gr.Row(visible=False):
        inputs = api_controls(svc)
        a_out = gr.JSON(label="results")
        a_btn = gr.Button()
    image, strategy, *named = inputs
    a_btn.click(api_search(svc), [inputs[image], inputs[strategy]], a_out,
                inputs_kwargs={name: inputs[name] for name in named}, api_name="search")


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
