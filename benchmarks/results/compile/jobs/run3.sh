# Whole default jobs (`make run` defaults, 64 prompts, 2 actors), eager against compiled, one run in this order;
# the compiled ones first with a cold inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR), then warm.
cd "$(dirname "$0")/../../../.." && O=${OUT:-/tmp/compile_jobs4} && mkdir -p $O && rm -rf $O/inductor  # the repository root
run() { # name compile
  rm -rf $O/$1
  TORCHINDUCTOR_CACHE_DIR=$O/inductor /usr/bin/time -f "%e s wall" .venv/bin/python -m jobs.generate spectr.compile=$2 output_dir=$O/$1 progress=false mlflow.tracking_uri=sqlite:///$O/mlflow.db > $O/$1.log 2>&1
}
run eager5 false
run compiled_cold_kmajor true
run eager6 false
run compiled_warm_kmajor true
run eager7 false
echo done > $O/done3
