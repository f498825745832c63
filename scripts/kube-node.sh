#!/usr/bin/env bash
# Ensures the rest of a one-node Kubernetes cluster for the test that runs the manifests as
# real pods (k8s/cluster) and prints the directory holding the binaries: kubelet,
# kube-controller-manager, kube-scheduler, kube-proxy and kubectl, built from the same pinned
# wrapper module as kube-apiserver (k8s/tools/kubernetes, k8s.io/kubernetes v1.37.2).
#
# Built outside any workspace with CGO_ENABLED=0 (47 minutes measured on 2 cores the first
# time, while other builds shared the machine; kube-apiserver then reuses most packages from
# the Go build cache), stamped with the pinned version as Kubernetes' own build does, and
# reused while every binary is there and reports that version.
#
#   scripts/kube-node.sh     prints the directory of the binaries (building them if needed)
#
# Environment:
#   CURFEW_CACHE_DIR   cache root (default $HOME/.cache/curfew)
#
# Progress goes to stderr; the only thing on stdout is the directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
module="$root/k8s/tools/kubernetes"
version="$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 }' "$module/go.mod")"
if [[ ! "$version" =~ ^v1\.([0-9]+)\.[0-9]+$ ]]; then
  echo "kube-node: no pinned k8s.io/kubernetes version in $module/go.mod" >&2
  exit 1
fi
minor="${BASH_REMATCH[1]}"
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/kube-node-$version"
cmds=(kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

# works: every binary runs and reports the pinned version.
works() {
  local c out
  for c in "${cmds[@]}"; do
    [[ -x "$dir/bin/$c" ]] || return 1
    if [[ "$c" == kubectl ]]; then
      # The whole output, then its first line (a `| head -1` pipe can fail the binary's
      # later writes under pipefail).
      out="$(timeout 20 "$dir/bin/$c" version --client 2>&1)" || return 1
      out="${out%%$'\n'*}"
      [[ "$out" == "Client Version: $version" ]] || return 1
    else
      out="$(timeout 20 "$dir/bin/$c" --version 2>&1)" || return 1
      [[ "$out" == "Kubernetes $version" ]] || return 1
    fi
  done
}

if works; then
  echo "$dir/bin"
  exit 0
fi

# One build at a time per cache: a second caller waits for the first.
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if works; then
  echo "$dir/bin"
  exit 0
fi

echo "kube-node: building ${cmds[*]} $version into $dir/bin (up to an hour on 2 cores)" >&2
start=$(date +%s)
rm -rf "$dir/src" "$dir/bin.tmp"
mkdir -p "$dir/src" "$dir/bin.tmp"
cp "$module/go.mod" "$module/go.sum" "$module/tools.go" "$dir/src/"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
pkgs=()
for c in "${cmds[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
(
  cd "$dir/src"
  export GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=0
  go build -trimpath -ldflags "$ldflags" -o "$dir/bin.tmp/" "${pkgs[@]}"
) >&2
rm -rf "$dir/bin"
mv "$dir/bin.tmp" "$dir/bin"
echo "kube-node: built in $(( $(date +%s) - start )) s" >&2

if ! works; then
  echo "kube-node: the binaries in $dir/bin do not report version $version" >&2
  exit 1
fi
echo "$dir/bin"
