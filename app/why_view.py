"""The why panel's HTML: where a result sits under both configurations, and the eigen-directions
of the metrics' difference that moved its score, or where a side has a re-ranker, the
neighbourhood the re-ranker reads (the numbers: index/analysis/explain.py)."""
from __future__ import annotations

import html

from index.analysis.explain import Link, Placement, Support, Why

UP, DOWN = "#1a7f1a", "#c62828"


def _rank_text(p: Placement, k: int) -> str:
    if p.beyond:
        return f"<small>{html.escape(p.rank_text())}</small>"
    return f"{p.rank}" + ("" if p.in_top_k else f" <small>(not in the top {k})</small>")


def _score_text(p: Placement) -> str:
    if not p.reranked:
        return f"{p.score:.4f}"
    return f"{p.score:.4f} <small>({'under the strategy alone' if p.beyond else 'the re-ranker’s score'})</small>"


def move_text(why: Why) -> str:
    """'rank 3 → 17 ▼ 14' (green up, red down) and the score change; where a side is re-ranked,
    the ranks only (a re-ranker's score is on its own scale) and no arrow across its pool's edge."""
    a, b = why.left.rank, why.right.rank
    if why.left.beyond or why.right.beyond:
        arrow = "<b>(one rank is beyond a re-ranked list: not comparable)</b>"
    elif b < a:
        arrow = f'<b style="color:{UP}">▲ {a - b}</b>'
    elif b > a:
        arrow = f'<b style="color:{DOWN}">▼ {b - a}</b>'
    else:
        arrow = "<b>= same rank</b>"
    if why.change is None:
        return f"left → right: rank {a} → {b} {arrow}"
    return (f"left → right: rank {a} → {b} {arrow} · score {why.left.score:.4f} → {why.right.score:.4f} "
            f"(Δ {why.change.delta:+.4f})")


def bars_svg(rows: list[tuple[str, float, str]], width: int = 640, row_h: int = 22) -> str:
    """A horizontal bar per (label, value, tooltip), from a zero line: positive values right
    (green), negative left (red)."""
    lab_w, val_w = 270, 70
    mid = lab_w + (width - lab_w - val_w) / 2
    half = (width - lab_w - val_w) / 2 - 4
    scale = max((abs(v) for _, v, _ in rows), default=0.0) or 1.0
    h = row_h * len(rows) + 8
    out = [f'<svg class="why-bars" viewBox="0 0 {width} {h}" width="100%" style="max-width:{width}px" '
           'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">',
           f'<line x1="{mid}" y1="0" x2="{mid}" y2="{h}" stroke="#888"/>']
    for i, (label, v, tip) in enumerate(rows):
        y = 4 + i * row_h
        w = abs(v) / scale * half
        x = mid if v >= 0 else mid - w
        colour = UP if v >= 0 else DOWN
        out.append(f'<g><title>{html.escape(tip)}</title>'
                   f'<text x="{lab_w - 6}" y="{y + 14}" text-anchor="end">{html.escape(label)}</text>'
                   f'<rect x="{x:.1f}" y="{y + 3}" width="{max(w, 0.5):.1f}" height="{row_h - 8}" fill="{colour}"/>'
                   f'<text x="{width - 4}" y="{y + 14}" text-anchor="end">{v:+.4f}</text></g>')
    out.append("</svg>")
    return "".join(out)


def why_html(svc, why: Why) -> str:
    """The panel for one result: placement under both configurations, the decomposition of the
    score difference as bars, and per shown direction the gallery images that project most on it."""
    ids, labels = _shown(svc, [why.item_row, *(r for strip in why.strips for r, _ in strip)])
    item_id = int(ids[why.item_row])
    head = (f'<div style="display:flex;gap:14px;align-items:center">'
            f'<img src="{svc.thumbnail_uri(item_id, 96)}" width="72" alt="result">'
            f'<div><b>{html.escape(svc.class_name(int(labels[why.item_row])))}</b> · id {item_id}<br>'
            f'<table class="why-ranks"><tr><th></th><th>rank</th><th>score</th></tr>'
            f'<tr><td>left: {html.escape(why.left.label)}</td><td>{_rank_text(why.left, why.k)}</td>'
            f'<td>{_score_text(why.left)}</td></tr>'
            f'<tr><td>right: {html.escape(why.right.label)}</td><td>{_rank_text(why.right, why.k)}</td>'
            f'<td>{_score_text(why.right)}</td></tr></table>{move_text(why)}</div></div>')
    ch = why.change
    if ch is None:
        return f'<div class="why-panel">{head}{reranked_html(svc, why)}</div>'
    cosine = "cosine" in (ch.mode_a, ch.mode_b)
    if cosine:
        how = ("A cosine score is qᵀMx / (‖q‖_M ‖x‖_M). The difference splits into qᵀ(M_right − M_left)x over "
               "the right side's norm factor, summed over the eigen-directions (μᵢ, vᵢ) of M_right − M_left "
               "as μᵢ(vᵢᵀq)(vᵢᵀx) / (‖q‖‖x‖)_right, plus the change of the norms alone, "
               "qᵀM_left x · (1/(‖q‖‖x‖)_right − 1/(‖q‖‖x‖)_left). "
               f"Norm factor ‖q‖‖x‖: left {ch.norm_a:.4g}, right {ch.norm_b:.4g} (1 on a bilinear side).")
    else:
        how = ("A bilinear score is qᵀMx, so the difference is qᵀ(M_right − M_left)x = Σᵢ μᵢ(vᵢᵀq)(vᵢᵀx) over "
               "the eigen-directions (μᵢ, vᵢ) of M_right − M_left.")
    rows = []
    for i, d in enumerate(why.shown):
        space = f", {d.dim}-dim eigenspace" if d.dim > 1 else ""
        rows.append((f"d{i + 1}: μ = {d.eigenvalue:+.3g}{space}", d.term,
                     f"vᵀq = {d.q_proj:+.4f}, vᵀx = {d.x_proj:+.4f}"))
    others = sum(x.dim for x in ch.directions) - sum(d.dim for d in why.shown)
    if others:
        rows.append((f"the other {others} directions", why.rest, "their terms together"))
    if cosine:
        rows.append(("change of the norms", ch.norm_term, "qᵀM_left x · (1/n_right − 1/n_left)"))
    rows.append(("score difference (right − left)", ch.delta, f"the parts sum to {ch.parts_sum:+.6f}"))
    strips = []
    for i, (d, strip) in enumerate(zip(why.shown, why.strips, strict=True)):
        imgs = "".join(
            f'<img src="{svc.thumbnail_uri(int(ids[r]), 64)}" width="48" '
            f'title="{html.escape(svc.class_name(int(labels[r])))} · id {int(ids[r])} · vᵀx = {p:+.3f}" '
            f'style="display:inline-block;margin:1px;border:2px solid {UP if p >= 0 else DOWN}">' for r, p in strip)
        # a flex row: the page's stylesheet shows images as blocks, one under the other
        strips.append(f'<div class="why-strip"><small>d{i + 1} (μ = {d.eigenvalue:+.3g}): the gallery images '
                      f'projecting most on it (border: sign of vᵀx)</small>'
                      f'<div style="display:flex;flex-wrap:wrap;gap:2px">{imgs}</div></div>')
    return (f'<div class="why-panel">{head}<p style="font-size:13px">{html.escape(how)}</p>'
            f"{bars_svg(rows)}{''.join(strips)}</div>")


def _shown(svc, rows) -> tuple[dict[int, int], dict[int, int]]:
    """(row → id, row → label) of the gallery rows shown, read together (by row on a collection)."""
    rows = sorted({int(r) for r in rows})
    items = svc.items_at(rows)
    return ({r: int(i) for r, i in zip(rows, items.ids, strict=True)},
            {r: int(lab) for r, lab in zip(rows, items.labels, strict=True)})


def _thumbs(svc, links: list[Link], k: int, title, shown) -> str:
    ids, labels = shown
    return "".join(
        f'<img src="{svc.thumbnail_uri(int(ids[n.row]), 64)}" width="48" title="{html.escape(title(n, labels))}" '
        f'style="display:inline-block;margin:1px;border:2px solid {UP if n.far_rank <= k else "#bbb"}">'
        for n in links)


def support_html(svc, s: Support, k: int) -> str:
    """One re-ranked side: the query's nearest items and x's rank in each one's list; x's nearest
    items and each one's rank in the query's list (green border: within the top k)."""
    by_q, by_x = s.shared(k)
    shown = _shown(svc, [n.row for n in (*s.of_query, *s.of_item)])

    def cls(labels, n):
        return svc.class_name(int(labels[n.row]))

    q_strip = _thumbs(svc, s.of_query, k, lambda n, lab: (
        f"{cls(lab, n)} · the query's #{n.near_rank} (s = {n.near_score:.3f}) · ranks this result "
        f"#{n.far_rank} (s = {n.far_score:.3f})"), shown)
    x_strip = _thumbs(svc, s.of_item, k, lambda n, lab: (
        f"{cls(lab, n)} · this result's #{n.near_rank} (s = {n.near_score:.3f}) · the query's "
        f"#{n.far_rank} (s = {n.far_score:.3f})"), shown)
    return (f'<div class="why-support"><p style="font-size:13px"><b>{html.escape(s.side)}: '
            f'{html.escape(s.label)}</b> — {html.escape(s.rerank_doc)}</p>'
            f'<small>the query\'s {len(s.of_query)} nearest items (this result left out): <b>{by_q}</b> rank this '
            f'result in their own top {k}</small><div style="display:flex;flex-wrap:wrap;gap:2px">{q_strip}</div>'
            f'<small>this result\'s {len(s.of_item)} nearest items: <b>{by_x}</b> are in the query\'s top {k}</small>'
            f'<div style="display:flex;flex-wrap:wrap;gap:2px">{x_strip}</div></div>')


def reranked_html(svc, why: Why) -> str:
    """Instead of the decomposition: why it does not apply, and the neighbourhood each re-ranked
    side reads (index/analysis/explain.py)."""
    how = ("Under its strategy alone (the first search the re-ranker reads), the query's own item left out: "
           "neighbours that rank this result in their own top k (green border), and this result's neighbours "
           "that the query ranks in its top k, are the shared neighbourhood query expansion, database-side "
           "augmentation, diffusion and k-reciprocal encoding pull a result up with. It is evidence, not an "
           "exact split of the score. Hover a thumbnail for its ranks and scores.")
    return (f'<p style="font-size:13px">{html.escape(why.note)}</p><p style="font-size:13px">{html.escape(how)}</p>'
            + "".join(support_html(svc, s, why.k) for s in why.support))
