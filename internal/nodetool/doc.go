// Package nodetool runs examples/node-tool, the TypeScript curfew.tool.v1.ToolService, as
// a real process for tests: it builds it once with scripts/node.sh (which installs
// Node.js itself under CI=true), starts it on a free loopback port and reads the events
// it prints, one JSON line each. Without Node.js a test is skipped locally and fails
// under CI=true (meshproc.Missing).
package nodetool
