"""`search`: query any backend (the index directory's FAISS index, an on-disk IVF, Milvus) by
image or features, under a configuration: a strategy's M′, a mode and a re-ranker."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from core.atomic import check_file_target, write_json
from core.errors import UserError
from core.flags import add_shared_args

from ..backends.flags import backend_args, milvus_token
from ..backends.gallery import Gallery
from ..search_config import NO_RERANK, SearchConfig
from ..space import set_memory_budget
from ..threads import batch_threads
from .flags import key_values_from, rerank_args, strategy_args, strategy_params_from, threads_arg


def search_parser(sub) -> None:
    s = sub.add_parser("search", help="search by image file(s) or feature vectors under a refined metric")
    s.add_argument("--index", help="index directory to search (required with --backend faiss)")
    s.add_argument("--image", nargs="+", help="query image file(s)")
    s.add_argument("--features", help="query trunk features .npy (n × d or d)")
    s.add_argument("--checkpoint", help="model to embed query images (default: the index's own)")
    s.add_argument("--k", type=int, default=10,
                   help="results per query, at most the index size (default: %(default)s)")
    add_shared_args(s, "json", "device", "cache_memory")
    threads_arg(s)
    s.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    strategy_args(s)
    rerank_args(s)
    backend_args(s)
    s.set_defaults(func=cmd_search)


def cmd_search(args) -> int:
    """One path for every backend: open the gallery, resolve the mode (cosine falls back to
    bilinear for an indefinite M′), embed or load the queries, search through
    `SearchConfig.search` (the strategy's search, then any re-ranker), write the same JSON."""
    if args.json:
        check_file_target(args.json)
    if args.rerank_factor < 1:
        raise UserError(f"--rerank-factor must be ≥ 1, got {args.rerank_factor}")
    # once for the command: FAISS, the re-rankers' batches and torch (image queries) on every core
    # unless asked, numpy's BLAS on one thread (the batches' threads use the cores; a single
    # query's M′q is too small for BLAS threads)
    batch_threads(args.threads, torch=bool(args.image))
    set_memory_budget(args.cache_memory)
    given = {k: v for k, v in strategy_params_from(args).items() if v is not None}
    cfg = SearchConfig.of(args.strategy, given, args.mode, args.rerank, key_values_from(args.rerank_param),
                          strict=True)  # every setting checked before the index is read
    gallery = open_gallery(args)
    mode, note = gallery.resolve_mode(cfg.strategy, cfg.params, cfg.mode)
    cfg = cfg.with_mode(mode)
    if cfg.rerank != NO_RERANK:
        cfg.space(gallery)  # a backend that cannot re-rank refuses before any query is embedded
    feats, names, what = _queries(args, gallery)
    if note:
        print(f"note: {note}", file=sys.stderr)
    hits = cfg.search(gallery, feats, args.k, what=what)
    payload = {"backend": args.backend, "strategy": args.strategy,
               "params": given, "mode": mode, "rerank": cfg.rerank,
               "rerank_params": cfg.rerank_params if cfg.rerank != NO_RERANK else {}, "k": hits.k,
               "note": note,
               "queries": [{"query": n, "results": r} for n, r in zip(names, hits.results(), strict=True)]}
    if args.json:
        write_json(args.json, payload)
    else:
        print(json.dumps(payload, indent=1, ensure_ascii=False))
    return 0


def open_gallery(args) -> Gallery:
    """The gallery `search --backend faiss|ondisk|milvus` reads."""
    if args.backend == "faiss":
        from ..backends.search import Searcher
        from ..backends.store import read_index

        if not args.index:
            raise UserError("give --index (the index directory to search)")
        return Searcher(read_index(args.index, verify=not args.no_verify))
    if args.backend == "ondisk":
        from ..backends.ondisk import OnDiskIVF

        if not (args.ivf or args.index):
            raise UserError("--backend ondisk needs --ivf DIR (or --index IDX, whose IDX/ivf_ondisk is used)")
        return OnDiskIVF(args.ivf or Path(args.index) / "ivf_ondisk", nprobe=args.nprobe or None,
                         rerank_factor=args.rerank_factor)
    from ..backends.milvus_store import MilvusGallery

    if not (args.uri and args.collection):
        raise UserError("--backend milvus needs --uri and --collection")
    return MilvusGallery(args.uri, args.collection, milvus_token(args), nprobe=args.nprobe or None,
                         rerank_factor=args.rerank_factor)


def _queries(args, gallery: Gallery) -> tuple[np.ndarray, list[str], str]:
    """(query trunk features, a name per query, what error messages call them)."""
    if args.features:
        from core.arrays import check_matrix, load_npy

        what = f"query features file {args.features}"
        feats = check_matrix(load_npy(args.features, "query features"), what, allow_1d=True)
        return feats, [f"{args.features}[{i}]" for i in range(len(feats))], what
    if args.image:
        from ..embedder import ImageEmbedder  # torch: only image queries need a model

        info = gallery.info
        emb = ImageEmbedder(args.checkpoint or info.get("checkpoint") or "", info, device=args.device)
        return emb.features(args.image), list(args.image), "query features"
    raise UserError("give --image PATH... or --features F.npy")
