cd "$(dirname "$0")/../../../.." && mkdir -p ${OUT:-/tmp/compile_jobs}  # the repository root
run() { # name compile
  rm -rf ${OUT:-/tmp/compile_jobs}/$1
  /usr/bin/time -f "%e s wall" .venv/bin/python -m jobs.generate spectr.compile=$2 output_dir=${OUT:-/tmp/compile_jobs}/$1 progress=false mlflow.tracking_uri=sqlite:///${OUT:-/tmp/compile_jobs}/mlflow.db > ${OUT:-/tmp/compile_jobs}/$1.log 2>&1
}
run eager3 false
run compiled_warm_eager_selection true
run eager4 false
echo done > ${OUT:-/tmp/compile_jobs}/done2
