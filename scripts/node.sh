#!/usr/bin/env bash
# Installs the npm side of the build, pinned by committed package-lock.json files, with
# `npm ci` (exact versions, integrity-checked), and only when a lock file changed:
#
#   .tools/node         the protoc plugins of buf.gen.yaml (scripts/node-tools/package.json:
#                       @bufbuild/protoc-gen-es), linked into .tools/bin for buf generate
#   examples/node       the Node example's dependencies, then its build (tsc) into dist/
#   examples/node-tool  the Node tool server's dependencies, then its build into dist/
#   examples/openai-node  the official openai SDK, which e2e/openai_node_test.go drives
#                       curfew's OpenAI-compatible API with (no build)
#   .tools/axe          axe-core (scripts/axe/package.json), the accessibility checker
#                       the web console's browser test runs in its pages
#   .tools/mcp-everything  the MCP reference server @modelcontextprotocol/server-everything
#                       (scripts/mcp-everything/package.json), which the toolrunner's MCP
#                       source is tested against
#
#   scripts/node.sh            all of them
#   scripts/node.sh tools      the plugins only (scripts/generate.sh)
#   scripts/node.sh example    the example only
#   scripts/node.sh node-tool  the tool server only
#   scripts/node.sh mcp        the MCP reference server only
#   scripts/node.sh openai     the openai SDK client only
#   scripts/node.sh axe        axe-core only
#
# Needs Node.js >= 20 with npm. Without node it installs Debian's nodejs and npm when it
# runs as root under CI=true; otherwise it fails and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if [[ "${CI:-}" == true && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "node: installing Debian's nodejs and npm" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >&2
  else
    echo "node: Node.js >= 20 with npm is required (apt-get install nodejs npm)" >&2
    exit 1
  fi
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if (( major < 20 )); then
  echo "node: Node.js >= 20 is required, found $(node --version)" >&2
  exit 1
fi

lockhash() { sha256sum "$1/package-lock.json" "$1/package.json" | sha256sum | cut -c1-16; }

# ci DIR SRC: npm ci in DIR from SRC's package.json and lock, unless DIR holds that lock's
# install already.
ci() {
  local dir="$1" src="$2" h
  h="$(lockhash "$src")"
  if [[ -f "$dir/node_modules/.curfew-lock.$h" ]]; then
    return 0
  fi
  echo "node: npm ci in $dir" >&2
  if [[ "$dir" != "$src" ]]; then
    mkdir -p "$dir"
    cp "$src/package.json" "$src/package-lock.json" "$dir/"
  fi
  (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >&2)
  rm -f "$dir/node_modules/.curfew-lock."*
  touch "$dir/node_modules/.curfew-lock.$h"
}

if [[ "$what" == all || "$what" == tools ]]; then
  ci .tools/node scripts/node-tools
  mkdir -p .tools/bin
  ln -sf ../node/node_modules/.bin/protoc-gen-es .tools/bin/protoc-gen-es
fi
if [[ "$what" == all || "$what" == example ]]; then
  ci examples/node examples/node
  (cd examples/node && npm run --silent build >&2)
fi
if [[ "$what" == all || "$what" == node-tool ]]; then
  ci examples/node-tool examples/node-tool
  (cd examples/node-tool && npm run --silent build >&2)
fi
if [[ "$what" == all || "$what" == openai ]]; then
  ci examples/openai-node examples/openai-node
fi
if [[ "$what" == all || "$what" == axe ]]; then
  ci .tools/axe scripts/axe
fi
if [[ "$what" == all || "$what" == mcp ]]; then
  ci .tools/mcp-everything scripts/mcp-everything
fi
