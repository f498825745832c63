#!/usr/bin/env bash
# Regenerates gen/ from proto/ with the pinned local plugins (scripts/tools.sh): Go under
# gen/curfew, TypeScript under gen/ts (protoc-gen-es from npm, scripts/node.sh).
#   scripts/generate.sh          rewrite gen/
#   scripts/generate.sh --check  fail if gen/ differs from what proto/ generates
set -euo pipefail
cd "$(dirname "$0")/.."
CURFEW_SKIP_LINT_INSTALL=1 bash scripts/tools.sh
export PATH="$PWD/.tools/bin:$PATH"
buf lint
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  buf generate --template buf.gen.yaml -o "$tmp"
  if ! diff -r "$tmp/gen/curfew" gen/curfew || ! diff -r "$tmp/gen/ts" gen/ts; then
    echo "gen/ is stale: run scripts/generate.sh and commit the result" >&2
    exit 1
  fi
  echo "gen/ is up to date"
else
  rm -rf gen/curfew gen/ts
  buf generate
fi
