"""The flags that choose and tune a backend, one definition for every command that opens one
(`index search`, `index export`, `index ivf-build`, the app).  Imports nothing heavy: the app's
--help reads them."""
from __future__ import annotations

import os

BACKENDS = ("faiss", "ondisk", "milvus")


def backend_args(p) -> None:
    """--backend, --ivf, --nprobe, --rerank-factor and the Milvus flags, in their own group."""
    g = p.add_argument_group("backends other than the index directory's FAISS index")
    g.add_argument("--backend", choices=BACKENDS, default="faiss",
                   help="faiss: --index's own index in RAM; ondisk: an on-disk IVF (see `index ivf-build`); "
                        "milvus: a collection written by `index export --to milvus` (default: %(default)s)")
    g.add_argument("--ivf", help="ondisk: the on-disk IVF directory (default: INDEX/ivf_ondisk)")
    g.add_argument("--nprobe", type=int, default=0,
                   help="ondisk, and milvus IVF_* collections: inverted lists probed; 0 = 32 (at most nlist) "
                        "for ondisk, Milvus's own for milvus (default: %(default)s)")
    g.add_argument("--rerank-factor", type=int, default=10,
                   help="ondisk, and milvus in cosine mode, on a non-FLAT collection or under a re-ranker: "
                        "candidates fetched per result for the exact re-rank under M′, × 4 for milvus in cosine "
                        "mode (the on-disk IVF searches cosine in the strategy's cosine lists) "
                        "(default: %(default)s)")
    milvus_args(g)


def milvus_args(p) -> None:
    p.add_argument("--uri", help="Milvus: a file path ending in .db (Milvus Lite, embedded) or "
                                 "http://host:19530 (a server or cluster)")
    p.add_argument("--collection", help="Milvus collection name")
    p.add_argument("--token", help="Milvus token, 'user:password' or an API key "
                                   "(default: $MILVUS_TOKEN, else none)")


def milvus_token(args) -> str:
    return args.token if args.token is not None else os.environ.get("MILVUS_TOKEN", "")
