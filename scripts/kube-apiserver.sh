#!/usr/bin/env bash
# Ensures a kube-apiserver binary for the Kubernetes manifest test and prints its path: the
# real API server that k8s/apiserver applies the kustomize base and overlays to, with a
# server-side dry-run and strict field validation (over Debian's etcd, see scripts/etcd.sh).
#
# It is built from the Go module proxy through the pinned wrapper module
# k8s/tools/kubernetes (k8s.io/kubernetes plus a replace to the matching v0.x release
# for each of its staging modules), outside any workspace (about 7.5 minutes on 2 cores).
# The wrapper's go.mod, go.sum and tools.go are copied into a cache outside the repository
# and the binary is reused while it is there and reports the pinned version.
#
#   scripts/kube-apiserver.sh     prints the path of the binary (building it if needed)
#
# Environment:
#   CURFEW_CACHE_DIR   cache root (default $HOME/.cache/curfew)
#
# The version is the one pinned in k8s/tools/kubernetes/go.mod (k8s.io/kubernetes);
# it is stamped into the binary with -ldflags as Kubernetes' own build does, since a plain
# `go build` would report v0.0.0-master.
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$root/k8s/tools/kubernetes"
version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }' "$module/go.mod")"
if [[ ! "$version" =~ ^v1\.([0-9]+)\.[0-9]+$ ]]; then
  echo "kube-apiserver: no pinned k8s.io/kubernetes version in $module/go.mod" >&2
  exit 1
fi
minor="${BASH_REMATCH[1]}"
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/kube-apiserver-$version"
bin="$dir/bin/kube-apiserver"

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

# works: the binary runs and reports the pinned version ("Kubernetes v1.37.2").
works() {
  [[ -x "$bin" ]] || return 1
  local out
  out="$(timeout 20 "$bin" --version 2>&1)" || return 1
  [[ "$out" == "Kubernetes $version" ]]
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

echo "kube-apiserver: building kube-apiserver $version into $dir/bin (about 7.5 minutes)" >&2
start=$(date +%s)
rm -rf "$dir/src"
mkdir -p "$dir/src" "$dir/bin"
cp "$module/go.mod" "$module/go.sum" "$module/tools.go" "$dir/src/"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
# Outside the repository's workspace so that go.work plays no part in the build.
(
  cd "$dir/src"
  export GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=0
  go build -trimpath -ldflags "$ldflags" -o "$dir/bin/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
) >&2
mv -f "$dir/bin/kube-apiserver.tmp" "$bin"
echo "kube-apiserver: built in $(( $(date +%s) - start )) s" >&2

if ! works; then
  echo "kube-apiserver: $bin does not report version $version" >&2
  exit 1
fi
echo "$bin"
