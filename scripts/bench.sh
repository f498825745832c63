#!/usr/bin/env bash
# Runs the benchmarks recorded in docs/benchmarks.md and prints their results.
#
#   scripts/bench.sh                 # chain, cancel, memory, throughput, cancelfloor (about 20 minutes on 2 cores)
#   ONLY=chain scripts/bench.sh      # one of: chain, cancel, memory, amplify, tracing, throughput,
#                                    # cancelfloor, tracingrun, mtls, tools, openai
#
# Knobs (environment): OUT (results directory, default a new temp dir), CHAIN_COUNT (10),
# CHAIN_ROUNDS (100), CANCEL_ITERS (50, trees of 1 and 8 leaves), CANCEL_ITERS_64 (100,
# trees of 64 leaves), RTT_PINGS (3000), CURFEW_BENCH_RUNS (10000, memory),
# CURFEW_BENCH_AMP_SECONDS (60) and CURFEW_BENCH_AMP_LOADS ("rate=4,conc=2,conc=16")
# (amplify), TOOL_CANCEL_ITERS (200), TOOL_CALL_ITERS (1000), CURFEW_BENCH_MCP_SESSIONS (16),
# CURFEW_BENCH_MEM_ROUNDS (3) and CURFEW_BENCH_TOOL_CALLS (1000) (tools), FIRST_DELTA_ITERS (200),
# DISCONNECT_ITERS (5, each two rounds) and CURFEW_BENCH_DISCONNECT_STREAMS (64) (openai),
# THROUGHPUT_ROUNDS (8), CURFEW_BENCH_THROUGHPUT_RUNS (200) and CURFEW_BENCH_THROUGHPUT_CONC (4)
# (throughput), TRACING_RUN_ROUNDS (6) and CURFEW_BENCH_TRACE_RATIO (10 per mille) (tracingrun), CURFEW_BIN_DIR
# (reuse built binaries; by default they are built into $OUT/bin, private to this run, so
# that nobody's `make build` can swap them mid-run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

ONLY="${ONLY:-all}"
OUT="${OUT:-$(mktemp -d /tmp/curfew-bench-results-XXXXXX)}"
CHAIN_COUNT="${CHAIN_COUNT:-10}"
CHAIN_ROUNDS="${CHAIN_ROUNDS:-100}"
CANCEL_ITERS="${CANCEL_ITERS:-50}"
CANCEL_ITERS_64="${CANCEL_ITERS_64:-100}"
mkdir -p "$OUT"

RTT_PINGS="${RTT_PINGS:-3000}"
TOOL_CANCEL_ITERS="${TOOL_CANCEL_ITERS:-200}"
TOOL_CALL_ITERS="${TOOL_CALL_ITERS:-1000}"
FIRST_DELTA_ITERS="${FIRST_DELTA_ITERS:-200}"
DISCONNECT_ITERS="${DISCONNECT_ITERS:-5}"
THROUGHPUT_ROUNDS="${THROUGHPUT_ROUNDS:-8}"
TRACING_RUN_ROUNDS="${TRACING_RUN_ROUNDS:-6}"
export CURFEW_BENCH_RAW="$OUT" # per-iteration samples of the cancel benchmark, as CSV

if [[ -z "${CURFEW_BIN_DIR:-}" ]]; then
  make --no-print-directory build BIN="$OUT/bin" >&2
  export CURFEW_BIN_DIR="$OUT/bin"
fi

{
  echo "## machine"
  echo "date:     $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "nproc:    $(nproc)"
  echo "cpu:      $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "memory:   $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "kernel:   $(uname -r)"
  echo "go:       $(go version)"
  echo "commit:   $(git rev-parse --short HEAD 2>/dev/null || echo unknown) ($(git status --porcelain 2>/dev/null | grep -vc '^??' || true) tracked files modified)"
  echo "load:     $(cut -d' ' -f1-3 /proc/loadavg) (1, 5, 15 min) at start"
} | tee "$OUT/machine.txt"
git status --porcelain 2>/dev/null | grep -v '^??' >"$OUT/git-status.txt" || true

# The bench package's test binary, built once.
go test -c -o "$OUT/bench.test" ./bench
BT="$OUT/bench.test"

run_chain() {
  echo
  echo "## chain overhead: unary health Check, bare grpc-go vs the curfew chain, loopback TCP"
  "$BT" -test.run '^$' -test.bench '^BenchmarkChain$' -test.count "$CHAIN_COUNT" -test.benchtime 1s |
    tee "$OUT/chain.txt"
  # benchstat compares files: one per setup, under a common benchmark name.
  grep 'BenchmarkChain/Bare' "$OUT/chain.txt" | sed 's#BenchmarkChain/Bare#BenchmarkHealthCheck#' >"$OUT/chain-bare.txt"
  grep 'BenchmarkChain/Chain' "$OUT/chain.txt" | sed 's#BenchmarkChain/Chain#BenchmarkHealthCheck#' >"$OUT/chain-chain.txt"
  local gobin
  gobin="$(mktemp -d)"
  if GOBIN="$gobin" GOFLAGS= go install golang.org/x/perf/cmd/benchstat@latest >/dev/null 2>&1; then
    echo
    "$gobin/benchstat" bare="$OUT/chain-bare.txt" chain="$OUT/chain-chain.txt" | tee "$OUT/chain-benchstat.txt"
  else
    echo "benchstat could not be installed; compare $OUT/chain-bare.txt and $OUT/chain-chain.txt" >&2
  fi
  rm -rf "$gobin"
  echo
  echo "## chain overhead: per-call latency, interleaved"
  CURFEW_BENCH_TABLE=1 "$BT" -test.run '^$' -test.bench '^BenchmarkChainLatency$' -test.count 3 \
    -test.benchtime "${CHAIN_ROUNDS}x" | tee "$OUT/chain-latency.txt"
}

run_cancel() {
  echo
  echo "## floor: loopback TCP round trip to an idle process"
  "$BT" -test.run '^$' -test.bench '^BenchmarkLoopbackRTT$' -test.benchtime "${RTT_PINGS}x" | tee "$OUT/rtt.txt"
  echo
  echo "## cancel propagation, real processes: trees of 1 and 8 leaves, ${CANCEL_ITERS} iterations per cell"
  "$BT" -test.run '^$' -test.bench '^BenchmarkCancelPropagation$/^leaves=(1|8)$/' \
    -test.benchtime "${CANCEL_ITERS}x" -test.timeout 30m | tee "$OUT/cancel-small.txt"
  echo
  echo "## cancel propagation, real processes: trees of 64 leaves, ${CANCEL_ITERS_64} iterations per cell"
  "$BT" -test.run '^$' -test.bench '^BenchmarkCancelPropagation$/^leaves=64$/' \
    -test.benchtime "${CANCEL_ITERS_64}x" -test.timeout 30m | tee "$OUT/cancel-64.txt"
}

run_memory() {
  echo
  echo "## memory per in-flight run, ${CURFEW_BENCH_RUNS:-10000} runs, real processes"
  "$BT" -test.run '^$' -test.bench '^BenchmarkRunMemory$' -test.benchtime 1x -test.timeout 30m |
    tee "$OUT/memory.txt"
}

run_amplify() {
  echo
  echo "## retry amplification, curfew vs naive, real processes: ${CURFEW_BENCH_AMP_LOADS:-rate=4,conc=2,conc=16}, ${CURFEW_BENCH_AMP_SECONDS:-60} s per cell"
  "$BT" -test.run '^$' -test.bench '^BenchmarkRetryAmplification$' -test.benchtime 1x -test.timeout 30m |
    tee "$OUT/amplify.txt"
}

run_tracing() {
  # Without CURFEW_OTELCOL only chain, off and noop are measured (no export).
  export CURFEW_OTELCOL="${CURFEW_OTELCOL:-$(bash scripts/otelcol.sh)}"
  echo
  echo "## tracing overhead on the chain: none, off, no-op handlers, export to a collector on loopback"
  "$BT" -test.run '^$' -test.bench '^BenchmarkChainTracing$' -test.count 3 | tee "$OUT/tracing.txt"
  "$BT" -test.run '^$' -test.bench '^BenchmarkChainTracingLatency$' -test.count 3 \
    -test.benchtime "${CHAIN_ROUNDS}x" | tee "$OUT/tracing-latency.txt"
}

run_throughput() {
  echo
  echo "## throughput: CPU per run of a small plan, the mesh against bare grpc-go on the same processes, alternating"
  "$BT" -test.run '^$' -test.bench '^BenchmarkThroughput$' -test.count 2 \
    -test.benchtime "${THROUGHPUT_ROUNDS}x" -test.timeout 30m | tee "$OUT/throughput.txt"
}

run_cancelfloor() {
  echo
  echo "## cancel at 64 leaves beside bare grpc-go's own cancel, alternating, ${CANCEL_ITERS_64} iterations per side"
  "$BT" -test.run '^$' -test.bench '^BenchmarkCancelFloor$' \
    -test.benchtime "${CANCEL_ITERS_64}x" -test.timeout 60m | tee "$OUT/cancel-floor.txt"
}

run_tracingrun() {
  export CURFEW_OTELCOL="${CURFEW_OTELCOL:-$(bash scripts/otelcol.sh)}"
  echo
  echo "## tracing on real runs: off, on (100 %, to the collector), parent-based ratio; alternating"
  "$BT" -test.run '^$' -test.bench '^BenchmarkTracingRun$' -test.count 2 \
    -test.benchtime "${TRACING_RUN_ROUNDS}x" -test.timeout 60m | tee "$OUT/tracing-run.txt"
}

run_mtls() {
  echo
  echo "## mTLS on the hop: the hop as served, plaintext vs mTLS (--tls-dir), interleaved"
  "$BT" -test.run '^$' -test.bench '^BenchmarkHopMTLS$' -test.count 3 \
    -test.benchtime "${CHAIN_ROUNDS}x" | tee "$OUT/mtls.txt"
}

run_tools() {
  echo
  echo "## tools: MCP cancel and call, curfew's toolrunner beside a bare go-sdk client; memory per session and call"
  "$BT" -test.run '^$' -test.bench '^BenchmarkToolCancel$' -test.count 3 \
    -test.benchtime "${TOOL_CANCEL_ITERS}x" | tee "$OUT/tool-cancel.txt"
  "$BT" -test.run '^$' -test.bench '^BenchmarkToolCall$' -test.count 3 \
    -test.benchtime "${TOOL_CALL_ITERS}x" | tee "$OUT/tool-call.txt"
  "$BT" -test.run '^$' -test.bench '^BenchmarkToolMemory$' -test.benchtime 1x | tee "$OUT/tool-memory.txt"
}

run_openai() {
  # The model server (openaitest) is built by the benchmarks unless CURFEW_BIN_DIR has one.
  echo
  echo "## real models in the loop: time to first delta, front door and Run against the model server directly"
  "$BT" -test.run '^$' -test.bench '^BenchmarkFirstDelta$' -test.count 3 \
    -test.benchtime "${FIRST_DELTA_ITERS}x" -test.timeout 30m | tee "$OUT/first-delta.txt"
  echo
  echo "## real models in the loop: disconnect at the front door to the upstream streams closed, against the model server directly"
  "$BT" -test.run '^$' -test.bench '^BenchmarkFrontDoorDisconnect$' -test.count 3 \
    -test.benchtime "${DISCONNECT_ITERS}x" -test.timeout 30m | tee "$OUT/disconnect.txt"
}

case "$ONLY" in
  tools) run_tools ;;
  openai) run_openai ;;
  all) run_chain; run_cancel; run_memory; run_throughput; run_cancelfloor ;;
  mtls) run_mtls ;;
  amplify) run_amplify ;;
  tracing) run_tracing ;;
  throughput) run_throughput ;;
  cancelfloor) run_cancelfloor ;;
  tracingrun) run_tracingrun ;;
  chain) run_chain ;;
  cancel) run_cancel ;;
  memory) run_memory ;;
  *) echo "ONLY must be all, chain, cancel, memory, amplify, tracing, throughput, cancelfloor, tracingrun, mtls, tools or openai" >&2; exit 2 ;;
esac
echo
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "results in $OUT"
