"""Embed a data-set split with a backbone or a trained model."""
from __future__ import annotations


from model.inference import extract

from .config import DataConfig
from .data.loader import make_loader, transform_for


def embed_subset(fn, subset, spec, cfg: DataConfig, desc: str, progress: bool = True):
    """Returns (features, labels, kept indices, skipped) for a Subset."""
    loader = make_loader(subset, spec.build(), batch_size=cfg.eval_batch_size, workers=cfg.workers)
    return extract(fn, loader, desc=desc, progress=progress)


def evaluate_model_on_split(fn, backbone, splits, split: str, cfg: DataConfig, *, ks,
                            normalize: bool = True, progress: bool = True) -> dict:
    """Embed `split` (or In-Shop's query/gallery) with `fn` and run the evaluator."""
    from evaluation import evaluate

    spec = transform_for(backbone, cfg.resolved_image_size(), cfg.dataset)
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


def backbone_fn(backbone):
    backbone.eval()
    return lambda x: backbone(x)
