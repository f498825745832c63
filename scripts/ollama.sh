#!/usr/bin/env bash
# Ensures an ollama server binary for the "real inference server" tests and prints its path.
#
# The binary is built from source with `go install` (cgo; it compiles llama.cpp, about 6
# minutes on 2 cores) into a cache outside the repository, and reused while it is there and
# reports the pinned version. Only v0.6.8 is known to build from its module download here:
# later versions miss C headers in the module zip.
#
#   scripts/ollama.sh            prints the path of the binary (building it if needed)
#
# Environment:
#   CURFEW_CACHE_DIR   cache root (default $HOME/.cache/curfew)
#   CURFEW_OLLAMA_VERSION  the pinned version (default v0.6.8; change with care)
#
# Progress goes to stderr; the only thing on stdout is the path.
set -euo pipefail

version="${CURFEW_OLLAMA_VERSION:-v0.6.8}"
cache="${CURFEW_CACHE_DIR:-${HOME:-/root}/.cache/curfew}"
dir="$cache/ollama-$version"
bin="$dir/bin/ollama"

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

# works: the binary was built from the pinned module version (its embedded build info says
# so) and it runs: `--version` prints the version stamped in at build time (plus a warning
# that no server is listening, which is fine).
works() {
  [[ -x "$bin" ]] || return 1
  go version -m "$bin" 2>/dev/null | grep -Eq "^[[:space:]]+mod[[:space:]]+github.com/ollama/ollama[[:space:]]+$version([[:space:]]|\$)" || return 1
  local out
  out="$(OLLAMA_HOST=127.0.0.1:1 HOME="$dir" timeout 20 "$bin" --version 2>&1)" || return 1
  [[ "$out" == *"${version#v}"* ]]
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

echo "ollama: building github.com/ollama/ollama@$version into $dir/bin (cgo, several minutes)" >&2
start=$(date +%s)
tmpbin="$dir/bin.tmp"
rm -rf "$tmpbin"
mkdir -p "$tmpbin"
# Outside any workspace or module so that our go.mod/go.work play no part in the build.
(
  cd "$dir"
  GOWORK=off GOFLAGS=-buildvcs=false CGO_ENABLED=1 GOBIN="$tmpbin" \
    go install -ldflags "-s -w -X github.com/ollama/ollama/version.Version=${version#v}" \
    "github.com/ollama/ollama@$version"
) >&2
mkdir -p "$dir/bin"
mv -f "$tmpbin/ollama" "$bin"
rm -rf "$tmpbin"
echo "ollama: built in $(( $(date +%s) - start )) s" >&2

if ! works; then
  echo "ollama: $bin does not report version $version" >&2
  exit 1
fi
echo "$bin"
