#!/bin/bash
# The app on a Milvus server at N items: `app_scale.py prep`'s gallery (a tiny model's test
# images plus synthetic distractors) exported as an HNSW collection, its neighbour graph, αDBA's
# gallery and decoupled diffusion's rows (item_truncation = 63) built in the engine (`index
# graph`), then `app_load.py` through POST /api/search: the six default strategies, then the
# trained strategy (bilinear) plain and with each re-ranker.
#
#   milvus-server --data DIR &
#   bash bench/app_milvus.sh N TAG [plain]   # plain: no graph; none and αQE only
#   EXPORT=0 bash bench/app_milvus.sh N TAG  # the collection exported already: not again
#
# Results: bench/results/app_milvus/TAG/ (one app_load.py JSON per run, times.txt); the
# gallery in /tmp/app_TAG (kept for a rerun), the collection app_TAG on http://127.0.0.1:19530.
set -euo pipefail
N=$1; TAG=$2; MODE=${3:-all}
W=/tmp/app_$TAG; URI=${URI:-http://127.0.0.1:19530}; C=app_$TAG
OUT=bench/results/app_milvus/$TAG; mkdir -p "$OUT"; : > "$OUT/times.txt"
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
[ -d "$W/index" ] || $PY bench/app_scale.py prep --n "$N" --workdir "$W" > "$W.prep.log" 2>&1
if [ "${EXPORT:-1}" != 0 ]; then
t0=$(date +%s)
$PY -m index export --to milvus --index "$W/index" --uri "$URI" --collection "$C" --index-type HNSW --overwrite \
    --no-progress > /dev/null
echo "export_s $(( $(date +%s) - t0 ))" >> "$OUT/times.txt"
fi
if [ "$MODE" != plain ]; then
  t0=$(date +%s)
  $PY -m index graph --backend milvus --uri "$URI" --collection "$C" --strategy trained --mode bilinear --no-progress \
      --rerank diffusion_offline --rerank-param item_truncation=63
  echo "graph_s $(( $(date +%s) - t0 ))" >> "$OUT/times.txt"
fi
LOAD=($PY bench/app_load.py --index "$W/index" --backend milvus --uri "$URI" --collection "$C" --client http
      --clients 2 --cache-memory 512M)
"${LOAD[@]}" --queries 50 --out "$OUT/plain_six.json" > /dev/null
"${LOAD[@]}" --queries 50 --strategies trained:bilinear --out "$OUT/none.json" > /dev/null
for R in aqe dba kreciprocal diffusion diffusion_offline; do
  if [ "$MODE" = plain ] && [ "$R" != aqe ]; then continue; fi
  P=(); [ "$R" = diffusion_offline ] && P=(--rerank-param item_truncation=63)
  "${LOAD[@]}" --queries 25 --strategies trained:bilinear --rerank "$R" "${P[@]}" --out "$OUT/$R.json" > /dev/null
done
