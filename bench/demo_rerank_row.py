"""Wall time of the demo's re-ranker row: `best_reranker` on the demo's trained tail, called as
`python -m demo` calls it (the validation-selected strategy, the re-rankers of DEMO_RERANKERS, each
re-ranker's coarse grid on validation).

  python bench/demo_rerank_row.py [--cold]

Needs the demo's run (`python -m demo --no-ui` first).  --cold: an empty re-ranking cache
(a temporary XDG_CACHE_HOME), so the offline passes are included.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="start from an empty re-ranking cache")
    args = ap.parse_args()
    if args.cold:
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="rerank-cold-")
    from demo.pipeline import DEMO_RERANKERS, demo_tail_config
    from index.analysis.rerank_eval import best_reranker
    from index.build import split_features
    from index.search_config import SearchConfig

    cfg = demo_tail_config()
    ck, data = Path(cfg.out) / "best.pt", cfg.data_config()
    f, y, W = split_features(ck, data, "test", cfg.cache_dir, progress=False)
    vf, vy, _ = split_features(ck, data, "val", cfg.cache_dir, progress=False)
    setting = SearchConfig.of("diagonal-psd", {"r": 1.0, "seed": 0, "psd": "clip"}, "cosine")
    t = time.time()
    row = best_reranker((f, y), (vf, vy), W, setting, DEMO_RERANKERS)
    chosen = ", ".join(f"{k}={v}" for k, v in row.get("rerank_params", {}).items())
    print(f"best_reranker {time.time() - t:.1f} s ({'cold' if args.cold else 'warm'} cache): {row['rerank']}"
          f"{f'({chosen})' if chosen else ''}, "
          f"test MAP@R {100 * row['test']['map@r']:.2f} (none {100 * row['test_none']['map@r']:.2f})")


if __name__ == "__main__":
    main()
