#!/usr/bin/env bash
# Whole default jobs, interleaved: HEAD (traversal among auto's candidates) vs the same tree without them.
set -u
VENV=/work/main/.venv/bin/python
for round in 1 2 3; do
  for variant in with without; do
    tree=/tmp/trav/$variant
    out=/tmp/trav/out-$variant-$round
    rm -rf $out
    start=$(date +%s.%N)
    (cd $tree && SPECTR_CACHE_DIR=/tmp/trav/cache-$variant PYTHONPATH=$tree $VENV -m jobs.generate \
        output_dir=$out mlflow.tracking_uri=sqlite:////tmp/trav/mlflow-$variant.db progress=false \
        hydra.run.dir=/tmp/trav/hydra-$variant-$round > /tmp/trav/log-$variant-$round.txt 2>&1)
    end=$(date +%s.%N)
    echo "$round $variant $(echo "$end - $start" | bc) $(grep -E 'throughput|wall time|method  ' /tmp/trav/log-$variant-$round.txt | tr -s ' ' | tr '\n' '|')"
  done
done
