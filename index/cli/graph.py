"""`graph`: build a gallery's neighbour graph ahead of the first re-ranked search: every item's
top-L neighbour lists under a strategy's M′ and mode, and each row's extreme similarities, the
offline pass that dba, k-reciprocal and diffusion read; on an engine's gallery, also αDBA's
augmented gallery (a collection the engine indexes and searches), which would otherwise be
built by the first αDBA query; with `--rerank NAME`, that re-ranker's own offline part too
(diffusion_offline: every item's diffusion row).  A build cut short resumes from the last block
it wrote; later searches under the same configuration read what it stored.  On an engine, N
processes (`--part I/N`, one each, on any machines that reach it) build every artefact together."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict

from core.errors import UserError
from core.flags import add_shared_args

from ..backends.flags import backend_args
from ..backends.milvus_space import building_part, check_part
from ..backends.milvus_store import is_server_uri
from ..rerankers.dba import augmented
from ..rerankers.neighbours import MIN_LENGTH, extremes_digest, neighbour_lists, row_extremes
from ..rerankers.registry import RERANKERS, clipped
from ..search_config import SearchConfig
from ..space import set_memory_budget
from ..threads import batch_threads
from .flags import key_values_from, strategy_args, strategy_params_from, threads_arg
from .search import open_gallery


def graph_parser(sub) -> None:
    s = sub.add_parser("graph", help="build the gallery's neighbour lists and row extremes for re-ranking (resumable)")
    s.add_argument("--index", help="index directory (required with --backend faiss)")
    s.add_argument("--length", type=int, default=MIN_LENGTH,
                   help="neighbours per item (a re-ranker reads at most k1 + 2, k + 1 or n + 2 of them; "
                        "default: %(default)s, which every re-ranker's defaults fit)")
    s.add_argument("--no-extremes", action="store_true", help="skip the row extremes (only k-reciprocal reads them)")
    s.add_argument("--no-dba", action="store_true",
                   help="on an engine's gallery, skip αDBA's augmented gallery (its first αDBA query builds it)")
    s.add_argument("--dba-param", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="αDBA's parameters for the augmented gallery built in the engine, as `search --rerank dba "
                        "--rerank-param` takes them (default: none given, dba's defaults)")
    RERANKERS.add_argument(s, "--rerank", default="none",
                           help="also build this re-ranker's own offline part ahead of its first query, at the "
                                "parameters `search --rerank NAME --rerank-param …` gives it (dba: its augmented "
                                "gallery; diffusion_offline: every item's diffusion row; none: the lists alone)")
    s.add_argument("--rerank-param", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="a parameter of --rerank, as `search --rerank-param` takes it (default: none given)")
    s.add_argument("--part", default="0/1", metavar="I/N",
                   help="on an engine's gallery, build part I of N of each artefact (I from 0): start N processes, "
                        "one per part, on any machines; each waits for the others before the next artefact "
                        "(default: %(default)s, the whole build here)")
    s.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    add_shared_args(s, "progress", "cache_memory")
    threads_arg(s)
    strategy_args(s)
    backend_args(s)
    s.set_defaults(func=cmd_graph)


def parse_part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in str(text).split("/"))
    except ValueError:
        raise UserError(f"--part wants I/N (e.g. 0/4), got {text!r}") from None
    check_part(i, n)
    return i, n


def cmd_graph(args) -> int:
    if args.length < 1:
        raise UserError(f"--length must be ≥ 1, got {args.length}")
    part = parse_part(args.part)
    batch_threads(args.threads, torch=False)
    set_memory_budget(args.cache_memory)
    given = {k: v for k, v in strategy_params_from(args).items() if v is not None}
    cfg = SearchConfig.of(args.strategy, given, args.mode, strict=True)
    dba_params = RERANKERS.params("dba", key_values_from(args.dba_param, "--dba-param"))  # checked first
    entry = RERANKERS.get(args.rerank)
    rr_params = RERANKERS.params(args.rerank, key_values_from(args.rerank_param))
    if args.rerank != "none" and entry.spec.prepare is None:
        raise UserError(f"re-ranker {args.rerank!r} has no offline part beyond the neighbour lists this builds")
    gallery = open_gallery(args)
    mode, note = gallery.resolve_mode(cfg.strategy, cfg.params, cfg.mode)
    if note:
        print(f"note: {note}", file=sys.stderr)
    space = cfg.with_mode(mode).space(gallery)  # an engine's gallery: read by row, its lists stored there
    engine = not space.holds_gallery
    if part != (0, 1) and not engine:
        raise UserError(f"--part splits a build in an engine (--backend milvus); this gallery's artefacts are "
                        f"built in this process ({args.backend})")
    if part != (0, 1) and not is_server_uri(args.uri):
        raise UserError("--part needs a Milvus server: Milvus Lite (a .db file) is one process's")
    with building_part(*part) if engine else contextlib.nullcontext():
        return _build(args, space, engine, dba_params, entry, rr_params)


def _build(args, space, engine: bool, dba_params, entry, rr_params) -> int:
    lists = neighbour_lists(space, args.length, progress=args.progress)
    where = f" in the engine ({lists.rows.table.collection})" if engine else ""  # type: ignore[attr-defined]
    print(f"neighbour lists: {space.n:,} items × {lists.rows.shape[1]} ({lists.digest}){where}")
    if not engine and args.dba_param:
        print("note: --dba-param is not used on this backend: αDBA's augmented gallery is held in memory, built "
              "by the first αDBA search", file=sys.stderr)
    if engine and not args.no_dba:
        keys = augmented(space, dba_params, progress=args.progress)["keys"]
        print(f"αDBA's augmented gallery (n={dba_params.n}, alpha={dba_params.alpha:g}): {space.n:,} items in the "
              f"engine ({keys.table.collection})")  # type: ignore[attr-defined]
    if entry.spec.prepare is not None:  # one built above is found whole: nothing is built twice
        p = clipped(args.rerank, rr_params, space.n, whole=space.holds_gallery)
        entry.spec.prepare(space, p, progress=args.progress)
        print(f"{args.rerank}'s offline part ({', '.join(f'{k}={v}' for k, v in asdict(p).items())}): built"
              + (" in the engine" if engine else ""))
    if engine:
        print("row extremes: not built in the engine (k-reciprocal there runs within each query's pool, which "
              "reads none; its whole-gallery sets, sets=gallery, run on a copy of the gallery's vectors and build "
              "them there)")
    elif not args.no_extremes:
        row_extremes(space)
        print(f"row extremes: {space.n:,} items ({extremes_digest(space)})")
    return 0
