"""The app's event handlers: thin calls into `RetrievalService` that turn a UserError into a
visible message, so a bad upload never stops the app.  No layout (app/ui.py wires them); each
takes both panels' configurations as keyword values named by the controls (`config_from`)."""
from __future__ import annotations

import gradio as gr

from core.errors import UserError
from index.refinements import shared_params
from index.search_config import NO_RERANK, SearchConfig

from .compare_view import parse_state, state_query, write_exports
from .controls import SIDES, rerank_controls, rerank_key, visible_params
from .params import shown, spec_from
from .service import Panel, RetrievalService
from .why_view import why_html


def config_from(values: dict, side: str) -> SearchConfig:
    """One panel's configuration from the handlers' keyword values: `<side>_strategy`,
    `<side>_mode`, `<side>_<param>` for every strategy parameter, `<side>_rerank` (absent:
    "none") and the chosen re-ranker's parameters, `rerank_key(side, name, param)`."""
    params = {sp.name: values.get(f"{side}_{sp.name}") for sp in shared_params()}
    rerank = values.get(f"{side}_rerank") or NO_RERANK
    prefix = rerank_key(side, rerank, "")
    rerank_params = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
    return spec_from(values[f"{side}_strategy"], values[f"{side}_mode"], params, rerank, rerank_params)


def configs_from(values: dict) -> tuple[SearchConfig, SearchConfig]:
    """(left, right) from the handlers' keyword values (see `config_from`)."""
    return config_from(values, "left"), config_from(values, "right")


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


def gallery_items(svc: RetrievalService, panel: Panel) -> list:
    out = []
    for r in panel.results:
        mark = "" if r["correct"] is None else ("✓ " if r["correct"] else "✗ ")
        pictured = "" if r.get("has_image", True) else " · no image"
        out.append((svc.thumbnail(r["id"]), f"{mark}{r['class_name']} {r['score']:.2f}{pictured}"))
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


# on_search's outputs: left title, left gallery, right title, right gallery, status, results state,
# the two heatmaps, the metric report, the 2-D map, the share link
SEARCH_OUTPUTS = 11


class Handlers:
    """Each handler takes the two panels' configurations as keyword values (`config_from`)."""

    def __init__(self, svc: RetrievalService):
        self.svc = svc

    def _query(self, qstate, upload):
        if qstate and qstate.get("kind") == "item":
            return self.svc.query_from_item(int(qstate["id"]))
        return self.svc.query_from_upload(upload)

    def on_refresh(self, qstate, upload, k, **cfg):
        """on_search after a page load or a change of a control: with no query chosen yet there is
        nothing to search, and nothing to warn about (the Search button still warns)."""
        if not (qstate and qstate.get("kind") == "item") and upload is None:
            return (gr.update(),) * SEARCH_OUTPUTS
        return self.on_search(qstate, upload, k, **cfg)

    def on_search(self, qstate, upload, k, **cfg):
        """→ left title, left gallery, right title, right gallery, status, results state, left and
        right heatmaps, metric report, 2-D map, share link."""
        k = int(k)
        try:
            q = self._query(qstate, upload)
            lspec, rspec = configs_from(cfg)
            left, right = self.svc.compare(q, rspec, k, left=lspec)
            known = "" if q.label is None else f" Query class: **{self.svc.class_name(q.label)}**."
            overlap = self.svc.overlap(left, right)
            status = (f"Searched {len(self.svc.data.items):,} gallery items.{known} Overlap of the two top "
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
        """→ the file box, shown with the JSON and CSV files of the current comparison (in a fresh
        temp folder); hidden and emptied where there is nothing to export (the box is hidden until
        the first export: empty, it would take room on the Search tab)."""
        try:
            q = self._query(qstate, upload)
            lspec, rspec = configs_from(cfg)
            payload = self.svc.export(q, rspec, int(k), left=lspec)
        except UserError as e:
            gr.Warning(str(e))
            return gr.update(value=None, visible=False)
        return gr.update(value=list(write_exports(payload)), visible=True)

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
                      *(shown(c.rerank_params.get(sp.name, gr.update())) if name == c.rerank else gr.update()
                        for name, sp in rerank_controls())]
        return ({"kind": "item", "id": st["q"]}, self.svc.thumbnail(st["q"], size=200), st["k"], *sides,
                f"Opened the shared comparison of gallery item {st['q']}.")

    # ------------------------------------------------------------ the Compare tab
    def _comparison(self, k, cfg, progress=None, seed=0, sample=None):
        """The Compare tab's comparison; `seed` and `sample` (its size) are read where the gallery
        is above the size compared whole (`RetrievalService.sampled`)."""
        lspec, rspec = configs_from(cfg)
        seed = 0 if seed is None or seed == "" else int(seed)
        sample = None if sample is None or sample == "" else int(sample)
        return self.svc.comparison(rspec, lspec, k=int(k), progress=tracker(progress), seed=seed, sample=sample)

    def on_compare(self, qstate, which, k, colour, max_jaccard, seed=0, sample=None, progress=COMPARE_PROGRESS,
                   **cfg):
        """→ summary, AP scatter, disagreements table, their ids, cursor, per-class table."""
        try:
            cmp = self._comparison(k, cfg, progress, seed, sample)
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

    def on_filter(self, which, k, max_jaccard, seed=0, sample=None, progress=FILTER_PROGRESS, **cfg):
        try:
            max_j = None if max_jaccard is None or float(max_jaccard) >= 1 else float(max_jaccard)
            rows, ids = disagreement_table(self._comparison(k, cfg, progress, seed, sample), which, max_j)
        except UserError as e:
            gr.Warning(str(e))
            return [], [], -1
        return rows, ids, -1

    def on_class(self, k, seed, sample, evt: gr.SelectData, **cfg):
        """A per-class table row → that class's queries (table, ids)."""
        label = int(evt.row_value[1])
        try:
            rows = self._comparison(k, cfg, None, seed, sample).class_queries(label)
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
        msg = (f"{len(rows)} test queries with the largest AP change from {lspec.label()} to "
               f"{rspec.label()}. "
               "Click one to search with it.") if rows else "The two configurations agree on every query."
        return items, [x["id"] for x in rows], msg


def share_link(q, left: SearchConfig, right: SearchConfig, k: int) -> str:
    """The query string of this comparison (the page's script prefixes the page address)."""
    if q.self_id is None:
        return "(an uploaded query cannot be in a link: pick a gallery image to share)"
    try:
        return state_query(q.self_id, left, right, k)
    except UserError as e:
        return f"({e})"


QUERY_COLUMNS = ("id", "class", "AP left", "AP right", "ΔAP", "Jaccard@k")
CLASS_COLUMNS = ("class", "label", "n", "AP left", "AP right", "Δ", "mean Jaccard@k")


def query_row(r: dict) -> list:
    return [r["id"], r["class_name"], round(r["ap_a"], 4), round(r["ap_b"], 4), round(r["delta"], 4),
            round(r.get("jaccard", float("nan")), 3)]


def disagreement_table(cmp, which: str, max_jaccard: float | None = None) -> tuple[list, list]:
    rows = cmp.disagreements(which, max_jaccard=max_jaccard)
    return [query_row(r) for r in rows], [r["id"] for r in rows]


def report_md(side: str, spec: SearchConfig, rep: dict) -> str:
    return (f"**{side}: M = {spec.without_rerank().label()}**  \n"
            f"tr(M) = {rep['trace']:.4g} · ‖M‖_F = {rep['frobenius']:.4g} · "
            f"‖M_off‖_F = {rep['offdiag_frobenius']:.4g}  \n"
            f"principle 1 tr/‖·‖_F = {rep['trace_over_frobenius']:.4g} · principle 2 ‖·‖_F/tr = "
            f"{rep['frobenius_over_trace']:.4g}  \n"
            f"{'PSD' if rep['psd'] else 'indefinite'} (min eigenvalue {rep['min_eigenvalue']:.3g}), rank {rep['rank']}")


def api_search(svc: RetrievalService):
    """The /search API's function: the image, the strategy, then every other API parameter by name
    (`service.api_params()`), each optional."""
    def search(image, strategy="trained", **values) -> dict:
        """Search the gallery with an image under a metric (and a re-ranker); returns the ranked results."""
        try:
            return svc.api_search(image, {"strategy": strategy, **values})
        except UserError as e:
            raise gr.Error(str(e)) from None
    return search
