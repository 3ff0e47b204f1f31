#!/usr/bin/env bash
set -u
VENV=/work/main/.venv/bin/python
round=0
for variant in without with with without without with; do
  round=$((round+1))
  tree=/tmp/trav/$variant
  out=/tmp/trav/outb-$variant-$round
  rm -rf $out
  start=$(date +%s.%N)
  (cd $tree && SPECTR_CACHE_DIR=/tmp/trav/cache-$variant PYTHONPATH=$tree $VENV -m jobs.generate \
      output_dir=$out mlflow.tracking_uri=sqlite:////tmp/trav/mlflow-$variant.db progress=false \
      hydra.run.dir=/tmp/trav/hydrab-$variant-$round > /tmp/trav/logb-$variant-$round.txt 2>&1)
  end=$(date +%s.%N)
  echo "$round $variant $(echo "$end - $start" | bc) $(grep -E 'throughput|wall time|generated tokens' /tmp/trav/logb-$variant-$round.txt | tr -s ' ' | tr '\n' '|')"
done
