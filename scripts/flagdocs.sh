#!/usr/bin/env bash
# Writes the flag tables of the docs (docs/configuration.md, docs/cli.md) from the
# binaries' own -h output (scripts/flagdocs/main.go says how a page asks for one).
#   scripts/flagdocs.sh          build the binaries and rewrite the tables
#   scripts/flagdocs.sh --check  fail if a table differs from what the binaries print
set -euo pipefail
cd "$(dirname "$0")/.."
pages=(docs/configuration.md docs/cli.md)

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/curfew" ./cmd/curfew
for s in orchestrator toolrunner subagent modelproxy; do
  (cd "services/$s" && go build -o "$bin/$s" "./cmd/$s")
done

if [[ "${1:-}" == "--check" ]]; then
  mkdir "$bin/docs"
  cp "${pages[@]}" "$bin/docs/"
  go run ./scripts/flagdocs -bin "$bin" "$bin"/docs/*.md
  stale=0
  for p in "${pages[@]}"; do
    diff -u "$p" "$bin/docs/$(basename "$p")" || stale=1
  done
  if ((stale)); then
    echo "the flag tables in docs/ differ from the binaries' -h: run bash scripts/flagdocs.sh and commit the result" >&2
    exit 1
  fi
else
  go run ./scripts/flagdocs -bin "$bin" "${pages[@]}"
fi
