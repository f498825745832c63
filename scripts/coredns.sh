#!/usr/bin/env bash
# Ensures a CoreDNS binary for the one-node test cluster (k8s/cluster) and prints its path:
# the cluster DNS that resolves the headless Services' names to pod addresses, as in any
# kubeadm or kind cluster. Built from the Go module proxy through the pinned wrapper module
# k8s/tools/coredns (github.com/coredns/coredns), outside any workspace, with CGO_ENABLED=0,
# and reused from the cache while it reports the pinned version.
#
#   scripts/coredns.sh     prints the path of the binary (building it if needed)
#
# Environment:
#   CURFEW_CACHE_DIR   cache root (default $HOME/.cache/curfew)
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$root/k8s/tools/coredns"
version="$(awk '$1 == "require" && $2 == "github.com/coredns/coredns" { print $3 }' "$module/go.mod")"
if [[ ! "$version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "coredns: no pinned github.com/coredns/coredns version in $module/go.mod" >&2
  exit 1
fi
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/coredns-$version"
bin="$dir/bin/coredns"

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

# works: the binary runs and reports the pinned version ("CoreDNS-1.15.0").
works() {
  [[ -x "$bin" ]] || return 1
  local out
  # The whole output, then its first line: `| head -1` closes the pipe after one line,
  # and the binary's write of the second then fails (SIGPIPE), which pipefail reports.
  out="$(timeout 20 "$bin" -version 2>&1)" || return 1
  out="${out%%$'\n'*}"
  [[ "$out" == "CoreDNS-${version#v}" ]]
}

if works; then
  echo "$bin"
  exit 0
fi

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if works; then
  echo "$bin"
  exit 0
fi

echo "coredns: building CoreDNS $version into $dir/bin (a few minutes)" >&2
start=$(date +%s)
rm -rf "$dir/src"
mkdir -p "$dir/src" "$dir/bin"
cp "$module/go.mod" "$module/go.sum" "$module/tools.go" "$dir/src/"
(
  cd "$dir/src"
  export GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=0
  go build -trimpath -ldflags "-s -w" -o "$dir/bin/coredns.tmp" github.com/coredns/coredns
) >&2
mv -f "$dir/bin/coredns.tmp" "$bin"
echo "coredns: built in $(( $(date +%s) - start )) s" >&2

if ! works; then
  echo "coredns: $bin does not report version $version" >&2
  "$bin" -version >&2 || true
  exit 1
fi
echo "$bin"
