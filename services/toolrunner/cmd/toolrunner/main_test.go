package main

import (
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Only invalid configurations are tested: a valid one would start serving.
func TestRunRejectsBadConfiguration(t *testing.T) {
	cases := append(meshtest.CommonFlagCases(), []meshtest.FlagCase{
		{Name: "negative tool time", Args: []string{"--min-tool-time=-1s"}, Want: "--min-tool-time must not be negative"},
		{Name: "zero depth", Args: []string{"--max-subagent-depth=0"}, Want: "at least 1"},
		{Name: "zero fanout from env", Env: map[string]string{"CURFEW_MAX_SUBAGENT_FANOUT": "0"}, Want: "at least 1"},
		{Name: "unknown store scheme", Args: []string{"--store=mysql://db/curfew"}, Want: "--store"},
		{Name: "unreachable store from env", Env: map[string]string{"CURFEW_STORE": "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"}, Want: "--store"},
		{Name: "missing tools config", Args: []string{"--tools-config=/nonexistent/tools.json"}, Want: "--tools-config"},
		{Name: "tools config unknown field", Args: []string{"--tools-config=" + toolsFile(t, `{"sources": [{"name": "a", "kind": "grpc", "address": "x:1", "addr": "y"}]}`)},
			Want: `tools.json: sources[0]: unknown field "addr"`},
		{Name: "tools config inline secret from env", Env: map[string]string{"CURFEW_TOOLS_CONFIG": toolsFile(t,
			`{"sources": [{"name": "a", "kind": "mcp_http", "url": "https://x/mcp", "headers": {"Authorization": "Bearer x"}}]}`)},
			Want: `sources[0].headers["Authorization"]: inline values are not allowed`},
		{Name: "bad fanout from env", Env: map[string]string{"CURFEW_MAX_SUBAGENT_FANOUT": "many"}, Want: "CURFEW_MAX_SUBAGENT_FANOUT"},
	}...)
	meshtest.RunFlagCases(t, "toolrunner", run, cases)
}

// toolsFile writes a tools configuration file and returns its path.
func toolsFile(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tools.json")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
