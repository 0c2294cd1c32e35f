#!/usr/bin/env bash
# Regenerate the benchmark JSON that docs/performance.md and the README's headline table are
# built from (short runs: a few minutes in all on a quiet 2-core machine). Run from the
# repository root after `pip install ".[bench]"`; then rebuild the docs, update the README's
# table with `python docs/_ext/strata_perf.py --readme --write`, and commit docs/perf/.
# One benchmark only: bash docs/perf/refresh.sh train_moe (paper: the --preset paper runs;
# regime_sweep: benchmarks/regime_sweep.py's points and PNGs)
set -euo pipefail
cd "$(dirname "$0")/../.."
# STRATA_PERF_DIR: another folder, e.g. docs/perf/jax-0.12.1 for the runs on another JAX
# release (docs/performance.md, On the newest JAX: .ci/newest-jax runs this script there).
P=${STRATA_PERF_DIR:-docs/perf}
CKPT="${TMPDIR:-/tmp}/strata_docs_moe_params.npz"
ONLY="${*:-}"
want() { [[ -z "$ONLY" || " $ONLY " == *" $1 "* ]]; }
run() { echo "+ $*" >&2; "$@"; }

if want train_moe; then
  run python benchmarks/train_moe.py --steps 30 --warmup 8 --save "$CKPT" --out $P/train_moe
  run python -m strata_jax.launch -n 4 benchmarks/train_moe.py --steps 30 --warmup 8 \
    --out $P/train_moe_launch4
fi
if want serve_moe; then
  [[ -f "$CKPT" ]] || run python benchmarks/train_moe.py --impl strata --steps 30 --save "$CKPT" \
    --out "${TMPDIR:-/tmp}/strata_docs_ckpt"
  run python benchmarks/serve_moe.py --load "$CKPT" --requests 4 --out $P/serve_moe
  run python -m strata_jax.launch -n 4 benchmarks/serve_moe.py --load "$CKPT" --requests 4 \
    --out $P/serve_moe_launch4
fi
if want train_recsys; then
  run python benchmarks/train_recsys.py --steps 40 --out $P/train_recsys
  run python -m strata_jax.launch -n 4 benchmarks/train_recsys.py --steps 40 \
    --out $P/train_recsys_launch4
fi
if want paper; then  # --preset paper (the paper's regime): docs/perf/<workload>_paper*/
  for w in train_moe serve_moe train_recsys; do
    CK=""; [[ $w == serve_moe ]] && CK="--ckpt-dir ${TMPDIR:-/tmp}/strata_docs_ckpt"
    run python benchmarks/$w.py --preset paper --out $P/${w}_paper $CK
    run python -m strata_jax.launch -n 4 benchmarks/$w.py --preset paper \
      --out $P/${w}_paper_launch4 $CK
  done
fi
if want regime_sweep; then
  run python benchmarks/regime_sweep.py --out $P/regime_sweep
fi
if want collectives; then
  run python benchmarks/collectives.py --op all -b 4K -e 16M -f 4 --out $P/collectives
  run python benchmarks/collectives.py --procs 4 --op psum,all_gather,psum_scatter,all_to_all \
    -b 4K -e 4M -f 4 --out $P/collectives_procs4
  run python benchmarks/collectives.py --procs 4 --hosts 2 \
    --op psum,all_gather,psum_scatter,all_to_all -b 4K -e 4M -f 4 --out $P/collectives_hosts2
fi
if want moe; then
  run python benchmarks/moe.py --iters 10 --out $P/moe
  run python benchmarks/moe.py --mode low_latency --ll-iters 50 --out $P/moe
fi
if want latency; then
  run python benchmarks/latency.py --procs 4 --op psum,all_gather -b 4K -e 64K --rounds 3 \
    --iters 40 --json $P/latency/latency_procs4.json
fi
if want registration; then
  run python benchmarks/registration.py --repeats 2 --steps 15 --out $P/registration
fi
