"""`training evaluate` on a model: embed a split (or In-Shop's query/gallery) and run the evaluator."""
from __future__ import annotations

from data import DataConfig
from evaluation import evaluate
from model.features import embed_subset
from model.preprocess import transform_for


def evaluate_model_on_split(fn, backbone, splits, split: str, cfg: DataConfig, *, ks,
                            normalize: bool = True, progress: bool = True) -> dict:
    """Embed `split` with `fn` (a backbone or a model) and evaluate it."""
    spec = transform_for(backbone, cfg)
    query, gallery = splits.eval_pair(split)
    q, ql, _, qskip = embed_subset(fn, query, spec, cfg, f"embed {query.name}", progress)
    if gallery is None:
        res = evaluate(q, ql, ks=ks, normalize=normalize)
        skipped = len(qskip)
    else:
        g, gl, _, gskip = embed_subset(fn, gallery, spec, cfg, f"embed {gallery.name}", progress)
        res = evaluate(q, ql, g, gl, ks=ks, normalize=normalize)
        skipped = len(qskip) + len(gskip)
    res["n_skipped_images"] = skipped
    return res
