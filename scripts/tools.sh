#!/usr/bin/env bash
# Installs the pinned code-generation and lint tools into .tools/bin (idempotent); the npm
# plugins through scripts/node.sh.
# Versions are pinned here and nowhere else; bump them in one commit.
set -euo pipefail
cd "$(dirname "$0")/.."
export GOBIN="$PWD/.tools/bin"
mkdir -p "$GOBIN"

BUF_VERSION=v1.75.0
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
GOLANGCI_LINT_VERSION=v2.15.0
# grpcurl runs the recipes of docs/api.md in e2e/grpcurl_test.go (Debian has no package of it).
GRPCURL_VERSION=v1.9.4

need() { # name version-string-marker
  [[ -x "$GOBIN/$1" && -f "$GOBIN/.$1.$2" ]]
}
install() { # name module version
  if ! need "$1" "$3"; then
    echo "tools: installing $2@$3" >&2
    go install "$2@$3"
    rm -f "$GOBIN/.$1."*
    touch "$GOBIN/.$1.$3"
  fi
}

install protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION"
install protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"
install buf github.com/bufbuild/buf/cmd/buf "$BUF_VERSION"
install grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl "$GRPCURL_VERSION"
# toxiproxy puts latency, resets and timeouts between the soak's replicas (curfew-soak
# --cluster, docs/soak.md); the same version as the client in go.mod. Its main package is
# named server: installed under the name toxiproxy-server.
TOXIPROXY_VERSION=v2.12.0
if ! need toxiproxy-server "$TOXIPROXY_VERSION"; then
  echo "tools: installing github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" >&2
  GOBIN="$GOBIN/.toxiproxy" go install "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION"
  mv "$GOBIN/.toxiproxy/server" "$GOBIN/toxiproxy-server"
  rmdir "$GOBIN/.toxiproxy"
  rm -f "$GOBIN/.toxiproxy-server."*
  touch "$GOBIN/.toxiproxy-server.$TOXIPROXY_VERSION"
fi
# The npm plugins of buf.gen.yaml (protoc-gen-es), pinned by scripts/node-tools/package-lock.json.
bash scripts/node.sh tools
# The MCP reference server the toolrunner's MCP source is tested against, pinned by
# scripts/mcp-everything/package-lock.json (its test fails under CI=true without it).
bash scripts/node.sh mcp
# The official openai SDK the OpenAI-compatible API is tested with, pinned by
# examples/openai-node/package-lock.json.
bash scripts/node.sh openai
# axe-core, which the web console's browser test runs in its pages, pinned by
# scripts/axe/package-lock.json.
bash scripts/node.sh axe
if [[ "${CURFEW_SKIP_LINT_INSTALL:-}" != 1 ]]; then
  install golangci-lint github.com/golangci/golangci-lint/v2/cmd/golangci-lint "$GOLANGCI_LINT_VERSION"
fi
