#!/usr/bin/env bash
# Ensures promtool (Prometheus's rule and metrics checker) and prints its path.
#
# promtool ships in Debian's `prometheus` package. Installing that package would also
# install and try to start a Prometheus server (port 9090) and pull in its recommends
# (node exporter, port 9100), so this does not install it: it downloads the package with
# `apt-get download` and unpacks only its files (`dpkg-deb -x`) into a cache outside the
# repository. Nothing runs, no port is taken, no service is registered. A promtool already
# on PATH is used as is.
#
#   scripts/promtool.sh          prints the path of promtool (fetching it if needed)
#
# Environment:
#   CURFEW_CACHE_DIR   cache root (default $HOME/.cache/curfew)
#   CURFEW_PROMTOOL    use this promtool and do nothing else
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

if [[ -n "${CURFEW_PROMTOOL:-}" ]]; then
  echo "$CURFEW_PROMTOOL"
  exit 0
fi
if command -v promtool >/dev/null 2>&1; then
  command -v promtool
  exit 0
fi
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/prometheus-deb"
bin="$dir/usr/bin/promtool"
if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
  echo "$bin"
  exit 0
fi

echo "promtool: fetching Debian's prometheus package (promtool only, no service)" >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && apt-get download prometheus >&2); }
if ! fetch; then
  # The package lists may be missing on a fresh machine; refreshing them needs root.
  if [[ "$(id -u)" == 0 ]]; then
    apt-get update >&2
    fetch
  else
    echo "promtool: apt-get download prometheus failed (run apt-get update as root, or set CURFEW_PROMTOOL)" >&2
    exit 1
  fi
fi
rm -rf "$dir"
mkdir -p "$dir"
dpkg-deb -x "$work"/prometheus_*.deb "$dir"
"$bin" --version >&2
echo "$bin"
