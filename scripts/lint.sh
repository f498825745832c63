#!/usr/bin/env bash
# gofmt, go vet (every module), buf lint, the generated flag tables of docs/, golangci-lint
# (config: .golangci.yml).
set -euo pipefail
cd "$(dirname "$0")/.."
CURFEW_SKIP_LINT_INSTALL=0 bash scripts/tools.sh
export PATH="$PWD/.tools/bin:$PATH"

unformatted=$(gofmt -l $(git ls-files '*.go' | grep -v '^gen/') 2>/dev/null || true)
if [[ -n "$unformatted" ]]; then
  echo "gofmt would change:" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet work
buf lint
# The flag tables of docs/cli.md and docs/configuration.md are the binaries' own -h.
bash scripts/flagdocs.sh --check
# Breaking-change check of the API against main (a no-op on main itself).
if git rev-parse --verify -q main >/dev/null && git ls-tree -d main proto >/dev/null 2>&1 && [[ -n "$(git ls-tree main proto)" ]]; then
  buf breaking --against ".git#branch=main"
fi
modules=(. mesh services/orchestrator services/toolrunner services/subagent services/modelproxy)
for m in "${modules[@]}"; do
  # --allow-serial-runners: wait for another golangci-lint on the machine (its lock is
  # machine-wide) instead of failing.
  (cd "$m" && golangci-lint run --allow-serial-runners --config "$OLDPWD/.golangci.yml" ./...)
done
# k8s/ is its own module outside go.work (the Kubernetes and kustomize dependencies stay
# out of the services' build list); vet and lint it on its own.
(cd k8s && GOWORK=off go vet ./... && GOWORK=off golangci-lint run --allow-serial-runners --config "$OLDPWD/.golangci.yml" ./...)
echo "lint: clean"
