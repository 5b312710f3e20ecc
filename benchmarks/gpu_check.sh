#!/usr/bin/env bash
# GPU checks, in parts; each part fits one device call of 10 minutes (the device tool's
# per-call limit), `all` does not. Run `essential` first: it is the one part a single GPU
# window (15 minutes of device time, start-up included) is sized for.
#   essential (step timeouts in ESSENTIAL_STEPS below, sum 475 s < 8 minutes): the machine,
#          the CUDA op built for sm_90 only, compute-sanitizer memcheck of the decode query
#          ops on tensors ending at their own allocations, then benchmarks/essential.py one
#          step per process: `query` (safe bmm on vLLM's strided view, absorbed bmm dense +
#          MXFP8 views, fused query projection BF16/MXFP8 -> BF16/FP8, CUDA-graph replay,
#          safe vs torch.bmm, direct vs BF16 pair, fused vs staged), `sparse` (sparse MLA
#          decode T 1/32 + extend T 4096, bf16 and fp8_ds_mla records (nvfp4_ds_mla: decode
#          only, plus its Triton writer under graph replay, byte-exact), LSE, graph replay, decode at
#          GLM-5 TP4 vs the HBM bandwidth measured in the same run, GLM-5.3-Flash decode
#          (latent 512 without RoPE, H 8/16, the 2176-wide top-k buffer), then DCP: per-rank LSE
#          through the Triton kernel under graph replay, merged vs DCP 1), `indexer` (insert,
#          logits, top-k vs the oracle, graph replay, decode vs HBM), `dsv4` (DeepSeek-V4's
#          Triton attention over window + compressed records with the sink, its record
#          writer and compressor vs the torch reference at decode and prefill shapes; writer
#          + attention under CUDA-graph replay on fresh inputs; decode vs HBM:
#          benchmarks/dsv4_attention.py). A failing or timed-out
#          step never stops the next. Writes $OUT/essential.json (every figure, versions,
#          commit), $OUT/essential.md (rows ready for benchmarks/RESULTS.md), essential.log,
#          build.log and memcheck.log, and prints the results table. Without CUDA (or with
#          VLLM_MLA_GPU_DRY=1) it runs dry: the same steps on CPU at tiny shapes (Triton
#          interpreter), GPU-only parts skip with a message, rows say "not run".
#          scripts/device_preflight.sh proves it imports and compiles under the GPU image's
#          Python 3.12 / torch 2.11 / Triton 3.6 beforehand.
#   query  (expected < 8 minutes on an H200; its step timeouts add up to 10 minutes):
#          build the stable-ABI CUDA op, memcheck it, gate correctness, time with graph replay.
#   sparse (step timeouts 240 + 120 s): benchmarks/sparse_mla.py (kernel correctness, graph
#          replay, DCP LSE graph replay merged vs DCP 1, 10k soak, roofline), then
#          benchmarks/sparse_ownership.py (allocator census around plan/prepare/bind/release
#          and a KV-pool rebind, graph replay after freeze).
#   decode (step timeouts 120 + 90 + 300 s): build the CUDA op, memcheck the decode
#          absorptions in every mode (benchmarks/decode_path.py --memcheck), then
#          benchmarks/decode_path.py: bmm (BF16 pair) vs safe vs direct (MXFP8 views) at GLM-5
#          TP4/TP8 and DeepSeek-V3 TP8 shapes, graph capture + replay, fused vs staged query,
#          host overhead of the route.
#   indexer (step timeouts 120 + 90 + 300 s): tests/test_sparse_indexer_triton.py on the
#          GPU (kernels vs the torch oracle, CUDA-graph capture), the kpool indexer's
#          Triton tests (GLM-5.3-Flash: pool compression at 4096 pools of 16, pool top-k), then
#          benchmarks/sparse_indexer.py: selections vs the oracle at DeepSeek-V3.2 / GLM-5
#          shapes to 128k, graph replay with changing inputs, decode time vs vLLM's DeepGEMM
#          indexer where it runs, % of the copy roofline.
#   soak   (step timeouts 240 + 240 + 90 s): `vllm-mla soak --device cuda`, 1,000 reload
#          cycles each of block FP8 (DeepGEMM form) and MXFP8 (FlashInfer form) with a CUDA
#          graph reading the pair replayed after every cycle (addresses, values, ledger,
#          allocated bytes), then 300 cycles of direct mode.
# The machine step runs for every part.
#   run through the device tool:  bash benchmarks/gpu_check.sh essential  (or another part;
#                                 default all = query..soak; writes under $OUT)
#   anywhere else:                OUT=/tmp/qp bash benchmarks/gpu_check.sh sparse
#   dry run here (CPU):           OUT=/tmp/e VLLM_MLA_GPU_DRY=1 bash benchmarks/gpu_check.sh essential
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
PY="${PYTHON:-python3}"
step() { echo; echo "== $* ($(date +%T))"; }
PART="${1:-all}"
case "$PART" in
  essential|query|sparse|decode|indexer|soak|all) ;;
  *) echo "usage: $0 [essential|query|sparse|decode|indexer|soak|all]   (got '$PART')" >&2
     exit 2 ;;
esac
want() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }

# ---- essential: one window. Step timeouts (seconds); tests/test_gpu_check_dry.py sums them.
ESSENTIAL_STEPS="machine:20 build:80 memcheck:55 query:105 sparse:120 indexer:50 dsv4:35 report:10"
t_of() { local kv; for kv in $ESSENTIAL_STEPS; do [ "${kv%%:*}" = "$1" ] && echo "${kv##*:}"; done; }
EXITS=()
timed() {  # name, command...: under the step's timeout; its exit code and seconds recorded
  local name="$1" limit start rc; shift
  limit="$(t_of "$name")"; start=$SECONDS
  step "essential: $name (timeout ${limit} s)"
  timeout --kill-after=5 "$limit" "$@"
  rc=$?
  EXITS+=(--step "$name=$rc:$((SECONDS - start))")
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "$name: TIMEOUT after ${limit} s"
  echo "$name exit $rc ($((SECONDS - start)) s)"
  return 0
}
skip() { echo "[$1] skipped: $2"; EXITS+=(--skip "$1=$2"); }

essential() {
  local dry="${VLLM_MLA_GPU_DRY:-}"
  rm -f "$OUT/essential.json" "$OUT/essential.md"
  timed machine "$PY" benchmarks/essential.py machine --out "$OUT"
  if [ -z "$dry" ]; then  # the machine step decided (no CUDA device visible to torch: dry)
    dry="$("$PY" -c "import json, sys; print(int(json.load(open(sys.argv[1]))['dry']))" \
      "$OUT/essential.json" 2>/dev/null)" || dry=""
    [ -n "$dry" ] || { nvidia-smi -L >/dev/null 2>&1 && dry=0 || dry=1; }
  fi
  [ "$dry" = 1 ] && echo "DRY RUN: plumbing only, no GPU figure (VLLM_MLA_GPU_DRY=1 or no CUDA)"
  export VLLM_MLA_GPU_DRY="$dry"

  if [ "$dry" = 1 ]; then
    skip build "dry run: no GPU (scripts/device_preflight.sh compiles csrc/ for sm_90)"
    skip memcheck "dry run: no GPU"
  else
    rm -f vllm_mla/_C*.so
    timed build bash -c 'VLLM_MLA_CUDA_ARCHS=90 "$0" setup.py build_ext --inplace > "$1" 2>&1
      rc=$?; [ $rc -eq 0 ] || tail -25 "$1"; exit $rc' "$PY" "$OUT/build.log"
    if command -v compute-sanitizer >/dev/null; then
      # No caching allocator: every tensor is its own cudaMalloc, so a read past a view
      # that ends at its allocation's end is outside any allocation and reported.
      timed memcheck bash -c 'PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer \
        --tool memcheck --error-exitcode 3 "$0" benchmarks/memcheck_query_bmm.py > "$1" 2>&1
        rc=$?; grep -E "ERROR SUMMARY|rel err|error" "$1" | tail -8; exit $rc' \
        "$PY" "$OUT/memcheck.log"
      # gVisor machines refuse the sanitizer ("Device not supported"): not a kernel failure
      grep -q "Device not supported" "$OUT/memcheck.log" 2>/dev/null \
        && skip memcheck "compute-sanitizer: Device not supported on this machine"
    else
      skip memcheck "compute-sanitizer not found"
    fi
  fi
  local s
  for s in query sparse indexer dsv4; do
    timed "$s" "$PY" benchmarks/essential.py "$s" --out "$OUT"
  done
  timed report "$PY" benchmarks/essential.py report --out "$OUT" "${EXITS[@]}" \
    --budget "$ESSENTIAL_STEPS"
  "$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if all(
    s.get('status') in ('ok', 'dry', 'skipped') for s in r['steps'].values()) else 1)" \
    "$OUT/essential.json"
}

if [ "$PART" = essential ]; then
  essential 2>&1 | tee "$OUT/essential.log"
  exit "${PIPESTATUS[0]}"
fi

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

build_op() {
step "build the CUDA op (sm_90 only, for time)"
rm -f vllm_mla/_C*.so
VLLM_MLA_CUDA_ARCHS="${VLLM_MLA_CUDA_ARCHS:-90}" timeout 120 "$PY" setup.py build_ext --inplace \
  > "$OUT/build.log" 2>&1
echo "build exit $?"; tail -5 "$OUT/build.log"
"$PY" -c "from vllm_mla.ops import query_bmm as q; print('cuda op loaded:', q.cuda_op_available(), q.cuda_op_error() or '')"
}

if want query; then
build_op

step "compute-sanitizer memcheck (tensors at the end of their allocations)"
if command -v compute-sanitizer >/dev/null; then
  # no caching allocator: each tensor is its own cudaMalloc, so its end is the allocation's
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$PY" benchmarks/memcheck_query_bmm.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|rel err|error" "$OUT/memcheck.log" | tail -12
else
  echo "compute-sanitizer not found; running without it"
  "$PY" benchmarks/memcheck_query_bmm.py
fi

if command -v compute-sanitizer >/dev/null; then
  for tool in racecheck synccheck; do
    step "compute-sanitizer $tool (cp.async ring, shared memory)"
    timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$PY" benchmarks/memcheck_query_bmm.py --safe-only > "$OUT/$tool.log" 2>&1
    echo "$tool exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -3
  done
fi

step "vllm-mla qualify on the GPU (allocator peaks and holes, baseline vs lean)"
timeout 60 "$PY" -m vllm_mla.tools.cli qualify --device cuda --json > "$OUT/qualify_cuda.json"
echo "qualify exit $?"
"$PY" - "$OUT/qualify_cuda.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for side in ("baseline", "lean"):
    print(side, {k: v for k, v in r[side].items()})
print("reclaimed", r["reclaimed_bytes"], "checks", r["checks"])
PY

step "correctness gate + CUDA-graph timing"
timeout 180 "$PY" benchmarks/query_path.py --out "$OUT/query_path.json" 2>&1 | tee "$OUT/query_path.txt"
echo "benchmark exit ${PIPESTATUS[0]}"
fi

if want sparse; then
step "sparse MLA: correctness, graph replay, soak, roofline"
timeout 240 "$PY" benchmarks/sparse_mla.py --out "$OUT/sparse_mla.json" 2>&1 | tee "$OUT/sparse_mla.txt"
echo "sparse_mla exit ${PIPESTATUS[0]}"

step "sparse MLA ownership: allocator census, pool rebind, graph replay after freeze"
timeout 120 "$PY" benchmarks/sparse_ownership.py --out "$OUT/sparse_ownership.json" 2>&1 \
  | tee "$OUT/sparse_ownership.txt"
echo "sparse_ownership exit ${PIPESTATUS[0]}"
fi

if want decode; then
want query || build_op
step "compute-sanitizer memcheck: decode absorptions, every mode"
if command -v compute-sanitizer >/dev/null; then
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$PY" benchmarks/decode_path.py --memcheck --out "$OUT/decode_memcheck.json" \
    > "$OUT/decode_memcheck.log" 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|correctness" "$OUT/decode_memcheck.log" | tail -4
fi
step "decode path: bmm vs safe vs direct, fused vs staged query, host overhead"
timeout 300 "$PY" benchmarks/decode_path.py --out "$OUT/decode_path.json" 2>&1 \
  | tee "$OUT/decode_path.txt"
echo "decode_path exit ${PIPESTATUS[0]}"
fi

if want indexer; then
step "DSA indexer kernels on the GPU: vs the torch oracle, CUDA-graph capture"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_sparse_indexer_triton.py \
  2>&1 | tee "$OUT/sparse_indexer_tests.txt" | tail -5
step "kpool indexer (GLM-5.3-Flash) pool compression and pool top-k on the GPU vs the oracle"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_kpool_indexer.py -k triton \
  2>&1 | tee "$OUT/kpool_indexer_tests.txt" | tail -5
step "DSA indexer: selections at DeepSeek-V3.2 / GLM-5 shapes, graph replay, speed vs vLLM"
timeout 300 "$PY" benchmarks/sparse_indexer.py --out "$OUT/sparse_indexer.json" 2>&1 \
  | tee "$OUT/sparse_indexer.txt"
echo "sparse_indexer exit ${PIPESTATUS[0]}"
fi

if want soak; then
step "soak: reload cycles on the GPU, a CUDA graph replayed after each (vllm_mla.tools.soak)"
for w in fp8-block-deepgemm mxfp8-flashinfer; do
  timeout 240 "$PY" -m vllm_mla.tools.cli soak --device cuda --weights "$w" --json \
    > "$OUT/soak_$w.json"
  echo "soak $w exit $?"; tail -16 "$OUT/soak_$w.json"
done
timeout 90 "$PY" -m vllm_mla.tools.cli soak --device cuda --weights mxfp8-flashinfer \
  --absorbed direct --no-release --cycles 300 --json > "$OUT/soak_direct.json"
echo "soak direct exit $?"; tail -16 "$OUT/soak_direct.json"
fi
