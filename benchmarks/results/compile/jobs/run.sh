cd "$(dirname "$0")/../../../.." && mkdir -p ${OUT:-/tmp/compile_jobs}  # the repository root
run() { # name compile
  rm -rf ${OUT:-/tmp/compile_jobs}/$1
  /usr/bin/time -f "%e s wall" .venv/bin/python -m jobs.generate spectr.compile=$2 output_dir=${OUT:-/tmp/compile_jobs}/$1 progress=false mlflow.tracking_uri=sqlite:///${OUT:-/tmp/compile_jobs}/mlflow.db > ${OUT:-/tmp/compile_jobs}/$1.log 2>&1
}
rm -rf /tmp/torchinductor_$(whoami)  # a cold inductor cache for the first compiled job
run eager1 false
run compiled_cold true
run compiled_warm true
run eager2 false
echo done > ${OUT:-/tmp/compile_jobs}/done
