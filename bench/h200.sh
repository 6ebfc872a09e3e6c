#!/usr/bin/env bash
# The H200 runs of this repo's benchmarks, through the device tool (docs/BENCHMARKS.md says
# which session ran what). Two calls back to back on one warm machine (it keeps /tmp about 30 s):
#   1. carry [".whl"]:      bash bench/h200.sh install     (the proxy's wheels into /tmp/site)
#   2. carry [".gpumodel", ".gpuwrk"]:  bash bench/h200.sh serve   (writes under $OUT)
#      (or, carrying an older checkout too: bash bench/h200.sh serve-ab OLD_DIR ROUNDS ...)
#      (or: bash bench/h200.sh index, which needs neither: recommend's device pass)
# Prepared here: ../shared/scripts/gpu-wheels fastapi uvicorn httptools langchain-core
#   langchain-classic llama-index-core faiss-cpu lmdb redis orjson pydantic-settings pyzmq msgspec
#   pytest-asyncio pytest-timeout; the fp16 model copy in .gpumodel/minilm-fp16 (docs/GPU_RUN.md);
#   wrk: apt-get download wrk libluajit-5.1-2 libluajit-5.1-common, each dpkg -x into .gpuwrk.
set -euo pipefail
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
export LD_LIBRARY_PATH=$PWD/.gpuwrk/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
MODEL=.gpumodel/minilm-fp16
case "${1:-}" in
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    python3 -c "import fastapi, zmq, msgspec, faiss, langchain_classic; print('installed')" ;;
  serve)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    shift
    python3 -m bench.serve_bench --engine torch --device cuda --model "$MODEL" \
      --wrk .gpuwrk/usr/bin/wrk --out "$OUT/serve" "$@" 2>&1 | tee "$OUT/serve_bench.txt" ;;
  serve-ab)  # serve in turns, OLD (another checkout: git archive into an ignored dir) then
    # this one, ROUNDS times, each on a fresh server: $OUT/<round>-old|new, the warm-up inputs
    # dropped (they are large); prints each run's batcher-alone line, table rows and the
    # device child's account
    old=${2:?usage: bash bench/h200.sh serve-ab OLD_DIR ROUNDS [serve_bench options]}
    rounds=${3:?usage: bash bench/h200.sh serve-ab OLD_DIR ROUNDS [serve_bench options]}
    shift 3
    root=$OUT
    for round in $(seq 1 "$rounds"); do
      for label in old new; do
        code=(); [ "$label" = old ] && code=(--code "$old")
        mkdir -p "$root/$round-$label"
        OUT=$root/$round-$label bash "$0" serve "$@" "${code[@]}" > /dev/null 2>&1 || true
        rm -f "$root/$round-$label"/serve/*.jsonl
        echo "== round $round, $label ($(date -u +%H:%M:%S) UTC)"
        grep -E "batcher alone|^\| [0-9]+ workers \| [0-9.]+ \||child over|threads:" \
          "$root/$round-$label/serve_bench.txt" | cut -c1-1600 || echo "(no result)"
      done
    done ;;
  recommend)
    shift
    python3 -m bench.recommend_bench --wrk .gpuwrk/usr/bin/wrk --out "$OUT/recommend" "$@" 2>&1 \
      | tee "$OUT/recommend_bench.txt" ;;
  index)  # recommend's device pass: its tests, then the pass in both forms on one 1M fleet
    python3 -m pytest -q -p no:cacheprovider tests/test_index_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/index_tests.txt"
    B="--snapshot /tmp/f1m --moves 0 100 --runs 3 --batches 100 --radius 3 10"
    python3 -m bench.device_pass_bench $B --label fused 2>&1 | grep -v USDT | tee "$OUT/fused.txt"
    python3 -m bench.device_pass_bench $B --label torch-ops --torch-ops 2>&1 | grep -v USDT \
      | tee "$OUT/torch_ops.txt" ;;
  pass-ab)  # the device pass of this checkout against OLD (another's indexes/ and features/,
    # e.g. git archive), in turns, pinned to one core: runs of one version differ by up to
    # 0.4 ms on that host, as much as a change
    old=${2:?usage: bash bench/h200.sh pass-ab OLD_DIR}
    B="--snapshot /tmp/f1m --moves 0 100 --runs 5 --batches 100 --radius 10"
    for label in new old new old new old; do
      P=$PWD:/tmp/site
      if [ "$label" = old ]; then P=$old:$PWD:/tmp/site; fi
      # by script path: ``python -m`` would put this checkout first
      PYTHONPATH=$P taskset -c 4 python3 bench/device_pass_bench.py $B --label "$label" 2>&1 \
        | grep -v USDT | tee -a "$OUT/pass_ab.txt"
    done ;;
  tests)
    FLEETCACHE_GPU_MODEL=$MODEL python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning \
      -W ignore::DeprecationWarning -W ignore::FutureWarning tests/test_gpu_torch.py ;;
  *) echo "usage: bench/h200.sh install | serve [serve_bench options] | serve-ab OLD_DIR ROUNDS [options] | recommend [options] | index | pass-ab OLD_DIR | tests" >&2
     exit 2 ;;
esac
