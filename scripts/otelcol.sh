#!/usr/bin/env bash
# Ensures an OpenTelemetry Collector binary for the tracing end-to-end test and prints its
# path: the real OTLP receiver the four services export their spans to.
#
# The collector is built with the OpenTelemetry Collector Builder (ocb) from the Go module
# proxy: only the otlp receiver and the debug exporter, at the pinned version (about 3.5
# minutes on 2 cores). The tests read the spans from the debug exporter's detailed output:
# contrib's file exporter does not build from the module proxy here (one of its test
# dependencies, otlpencodingextension, is not served at any recent version). It goes into a cache outside the repository and is
# reused while it is there and reports the pinned version.
#
#   scripts/otelcol.sh            prints the path of the binary (building it if needed)
#
# Environment:
#   CURFEW_CACHE_DIR         cache root (default $HOME/.cache/curfew)
#   CURFEW_OTELCOL_VERSION   the pinned version (default 0.165.0, without "v"; ocb and the
#                            components are released together under one version)
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

version="${CURFEW_OTELCOL_VERSION:-0.165.0}"
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/otelcol-v$version"
bin="$dir/bin/otelcol-curfew"

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

# works: the binary runs and reports the pinned version (ocb stamps dist.version in).
works() {
  [[ -x "$bin" ]] || return 1
  local out
  out="$(timeout 20 "$bin" --version 2>&1)" || return 1
  [[ "$out" == *"$version"* ]]
}

if works; then
  echo "$bin"
  exit 0
fi

# One build at a time per cache: a second caller waits for the first.
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if works; then
  echo "$bin"
  exit 0
fi

echo "otelcol: building the collector v$version (otlp receiver, debug exporter) into $dir/bin (a few minutes)" >&2
start=$(date +%s)
rm -rf "$dir/build" "$dir/tools"
mkdir -p "$dir/tools"
cat >"$dir/builder.yaml" <<EOF
dist:
  name: otelcol-curfew
  description: OpenTelemetry Collector for curfew's tracing tests
  output_path: $dir/build
  version: $version
receivers:
  - gomod: go.opentelemetry.io/collector/receiver/otlpreceiver v$version
exporters:
  - gomod: go.opentelemetry.io/collector/exporter/debugexporter v$version
EOF
# Outside any workspace or module so that our go.mod/go.work play no part in the build.
(
  cd "$dir"
  export GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=0
  GOBIN="$dir/tools" go install "go.opentelemetry.io/collector/cmd/builder@v$version"
  "$dir/tools/builder" --config "$dir/builder.yaml"
) >&2
mkdir -p "$dir/bin"
mv -f "$dir/build/otelcol-curfew" "$bin"
rm -rf "$dir/build"
echo "otelcol: built in $(( $(date +%s) - start )) s" >&2

if ! works; then
  echo "otelcol: $bin does not report version $version" >&2
  exit 1
fi
echo "$bin"
