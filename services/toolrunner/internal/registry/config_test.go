package registry

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/catalog"
)

func lookupEnv(name string) (string, bool) {
	v, ok := map[string]string{"GITHUB_TOKEN": "secret-token", "EMPTY": ""}[name]
	return v, ok
}

func lookPath(cmd string) (string, error) {
	if cmd == "npx" || cmd == "/usr/bin/tool" {
		return "/usr/bin/" + cmd, nil
	}
	return "", errors.New("executable file not found in $PATH")
}

func TestParseRejects(t *testing.T) {
	src := func(fields string) string { return `{"sources": [` + fields + `]}` }
	grpcTLS := func(tls string) string {
		return src(`{"name": "a", "kind": "grpc", "address": "x:1", "tls": ` + tls + `}`)
	}
	stdio := func(extra string) string {
		return src(`{"name": "gh", "kind": "mcp_stdio", "command": "npx"` + extra + `}`)
	}
	for _, tc := range []struct {
		name, file string
		want       []string // substrings of the error, field path first
	}{
		{"unknown top-level field", `{"sources": [], "source": []}`, []string{"the file", `unknown field "source"`}},
		{"unknown source field", stdio(`, "cmd": "x"`), []string{"sources[0]", `unknown field "cmd"`}},
		{"unknown tool field", stdio(`, "tools": {"search": {"side_effect": "none"}}`), []string{`sources[0].tools["search"]`, `unknown field "side_effect"`}},
		{"unknown retry field", stdio(`, "retry": {"attempts": 2}`), []string{"sources[0].retry", `unknown field "attempts"`}},
		{"wrong type", stdio(`, "concurrency": "4"`), []string{"sources[0].concurrency", "must be int"}},
		{"missing name", src(`{"kind": "grpc", "address": "x:1"}`), []string{"sources[0].name", "must be 1 to 32"}},
		{"underscore in name", src(`{"name": "my_tools", "kind": "grpc", "address": "x:1"}`), []string{"sources[0].name", "no underscores"}},
		{"reserved name", src(`{"name": "builtin", "kind": "grpc", "address": "x:1"}`), []string{"sources[0].name", "built-in"}},
		{"duplicate source", src(`{"name": "a", "kind": "grpc", "address": "x:1"}, {"name": "a", "kind": "grpc", "address": "y:1"}`),
			[]string{"sources[1].name", `duplicate source name "a"`, "sources[0]"}},
		{"missing kind", src(`{"name": "a"}`), []string{"sources[0].kind", "is required"}},
		{"unknown kind", src(`{"name": "a", "kind": "mcp_sse"}`), []string{"sources[0].kind", `unknown kind "mcp_sse"`}},
		{"missing command", src(`{"name": "a", "kind": "mcp_stdio"}`), []string{"sources[0].command", "is required"}},
		{"command not found", src(`{"name": "a", "kind": "mcp_stdio", "command": "no-such-mcp-server"}`), []string{"sources[0].command", `"no-such-mcp-server" is not an executable`}},
		{"dir not a directory", stdio(`, "dir": "/nonexistent/dir"`), []string{"sources[0].dir", "not a directory"}},
		{"url on stdio", stdio(`, "url": "https://x"`), []string{"sources[0].url", `not used by kind "mcp_stdio"`}},
		{"missing url", src(`{"name": "a", "kind": "mcp_http"}`), []string{"sources[0].url", "is required"}},
		{"bad url scheme", src(`{"name": "a", "kind": "mcp_http", "url": "ftp://x/mcp"}`), []string{"sources[0].url", "http:// or https://"}},
		{"url without host", src(`{"name": "a", "kind": "mcp_http", "url": "https:///mcp"}`), []string{"sources[0].url", "no host"}},
		{"unparsable url", src(`{"name": "a", "kind": "mcp_http", "url": "http://x:port/"}`), []string{"sources[0].url", "invalid port"}},
		{"credentials in url", src(`{"name": "a", "kind": "mcp_http", "url": "https://u:p@x/mcp"}`), []string{"sources[0].url", "credentials"}},
		{"missing address", src(`{"name": "a", "kind": "grpc"}`), []string{"sources[0].address", "is required"}},
		{"inline header", src(`{"name": "a", "kind": "mcp_http", "url": "https://x/mcp", "headers": {"Authorization": "Bearer abc"}}`),
			[]string{`sources[0].headers["Authorization"]`, "inline values are not allowed", "from_env"}},
		{"inline env", stdio(`, "env": {"TOKEN": "abc"}`), []string{`sources[0].env["TOKEN"]`, "inline values are not allowed"}},
		{"env var unset", stdio(`, "env": {"TOKEN": {"from_env": "NOT_SET_ANYWHERE"}}`), []string{`sources[0].env["TOKEN"].from_env`, "NOT_SET_ANYWHERE is not set"}},
		{"env without from_env", stdio(`, "env": {"TOKEN": {}}`), []string{`sources[0].env["TOKEN"].from_env`, "is required"}},
		{"bad side effects", stdio(`, "side_effects": "some"`), []string{"sources[0].side_effects", "none, idempotent or irreversible"}},
		{"bad duration", stdio(`, "min_time": "200"`), []string{"sources[0].min_time", "not a duration"}},
		{"negative duration", stdio(`, "tools": {"t": {"min_time": "-1s"}}`), []string{`sources[0].tools["t"].min_time`, "not a duration"}},
		{"zero concurrency", stdio(`, "concurrency": 0`), []string{"sources[0].concurrency", "at least 1"}},
		{"zero tool concurrency", stdio(`, "tools": {"t": {"concurrency": 0}}`), []string{`sources[0].tools["t"].concurrency`, "at least 1"}},
		{"zero output cap", stdio(`, "max_output_bytes": 0`), []string{"sources[0].max_output_bytes", "at least 1"}},
		{"empty tenants", stdio(`, "tenants": []`), []string{"sources[0].tenants", "every tenant"}},
		{"too many attempts", stdio(`, "retry": {"max_attempts": 9}`), []string{"sources[0].retry", "max_attempts must be between 1 and 5"}},
		{"non_idempotent in retry", stdio(`, "retry": {"non_idempotent": true}`), []string{"sources[0].retry.non_idempotent", "side_effects"}},
		{"trailing data", `{"sources": []} {}`, []string{"the file", "trailing data"}},
		{"tls on stdio", stdio(`, "tls": {}`), []string{"sources[0].tls", `not used by kind "mcp_stdio"`}},
		{"tls on http", src(`{"name": "a", "kind": "mcp_http", "url": "https://x/mcp", "tls": {}}`), []string{"sources[0].tls", `not used by kind "mcp_http"`}},
		{"unknown tls field", grpcTLS(`{"ca": "x"}`), []string{"sources[0].tls", `unknown field "ca"`}},
		{"cert without key", grpcTLS(`{"cert_file": "/x.pem"}`), []string{"sources[0].tls.key_file", "go together"}},
		{"key without cert", grpcTLS(`{"key_file": "/x.pem"}`), []string{"sources[0].tls.cert_file", "go together"}},
		{"missing ca file", grpcTLS(`{"ca_file": "/nonexistent/ca.pem"}`), []string{"sources[0].tls.ca_file", "no such file"}},
		{"ca file not PEM", grpcTLS(`{"ca_file": "config_test.go"}`), []string{"sources[0].tls.ca_file", "no PEM certificate"}},
		{"missing cert file", grpcTLS(`{"cert_file": "/nonexistent/c.pem", "key_file": "/nonexistent/k.pem"}`), []string{"sources[0].tls.cert_file", "no such file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.file), lookupEnv, lookPath)
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not mention %q", msg, w)
				}
			}
			if !strings.HasPrefix(msg, tc.want[0]) {
				t.Errorf("error %q does not start with the field %q", msg, tc.want[0])
			}
			if strings.Contains(msg, "secret-token") {
				t.Errorf("error %q leaks a secret", msg)
			}
		})
	}
}

func TestLoad(t *testing.T) {
	t.Setenv("REGISTRY_TEST_TOKEN", "abc")
	t.Setenv("PATH", os.Getenv("PATH"))
	t.Setenv("CURFEW_STORE", "postgres://must-not-leak")
	sh, err := os.Executable() // any executable path passes the command check
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "tools.json")
	file := `{"sources": [
	  {"name": "gh", "kind": "mcp_stdio", "command": "` + sh + `", "args": ["--stdio"], "dir": "/tmp",
	   "env": {"GITHUB_TOKEN": {"from_env": "REGISTRY_TEST_TOKEN"}},
	   "trusted": true, "side_effects": "idempotent", "min_time": "200ms", "concurrency": 4,
	   "retry": {"max_attempts": 2, "base": "10ms"}, "max_output_bytes": 1000, "tenants": ["acme"],
	   "tools": {"create_issue": {"side_effects": "irreversible", "concurrency": 1, "tenants": ["acme", "beta"]}}},
	  {"name": "search", "kind": "mcp_http", "url": "https://mcp.example.com/mcp",
	   "headers": {"Authorization": {"from_env": "REGISTRY_TEST_TOKEN"}}},
	  {"name": "inhouse", "kind": "grpc", "address": "dns:///tools.internal:7800"}]}`
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Sources) != 3 {
		t.Fatalf("%d sources", len(c.Sources))
	}
	gh := c.Sources[0]
	if *gh.Policy.SideEffects != catalog.Idempotent || *gh.Policy.MinTime != 200*time.Millisecond || *gh.Policy.Concurrency != 4 ||
		*gh.Policy.MaxOutputBytes != 1000 || *gh.Policy.Retry.MaxAttempts != 2 || !gh.Trusted {
		t.Errorf("gh policy: %+v", gh.Policy)
	}
	if tp := gh.Tools["create_issue"]; *tp.SideEffects != catalog.Irreversible || *tp.Concurrency != 1 || len(tp.Tenants) != 2 {
		t.Errorf("create_issue override: %+v", tp)
	}
	env := strings.Join(gh.Environ(), "\n")
	if !strings.Contains(env, "GITHUB_TOKEN=abc") || !strings.Contains(env, "PATH=") || strings.Contains(env, "must-not-leak") {
		t.Errorf("environ: %q", env)
	}
	if h := c.Sources[1].Header().Get("Authorization"); h != "abc" {
		t.Errorf("header: %q", h)
	}
	if c.Sources[2].Address != "dns:///tools.internal:7800" {
		t.Errorf("address: %q", c.Sources[2].Address)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.json")); err == nil {
		t.Error("a missing file loaded")
	}
	bad := filepath.Join(t.TempDir(), "bad.json")
	_ = os.WriteFile(bad, []byte(`{"sources": [{"name": "a", "kind": "grpc"}]}`), 0o600)
	if _, err := Load(bad); err == nil || !strings.Contains(err.Error(), bad+": sources[0].address") {
		t.Errorf("bad file: %v", err)
	}
}

// A grpc source is plaintext without tls (or with "tls": null); with it, TLS as it says.
func TestParseTLS(t *testing.T) {
	for file, want := range map[string]*TLSConfig{
		`{"sources": [{"name": "a", "kind": "grpc", "address": "x:1"}]}`:                                       nil,
		`{"sources": [{"name": "a", "kind": "grpc", "address": "x:1", "tls": null}]}`:                          nil,
		`{"sources": [{"name": "a", "kind": "grpc", "address": "x:1", "tls": {}}]}`:                            {},
		`{"sources": [{"name": "a", "kind": "grpc", "address": "x:1", "tls": {"server_name": "tools.team"}}]}`: {ServerName: "tools.team"},
	} {
		c, err := Parse([]byte(file), lookupEnv, lookPath)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		got := c.Sources[0].TLS
		if (got == nil) != (want == nil) || got != nil && *got != *want {
			t.Errorf("%s: tls %+v, want %+v", file, got, want)
		}
	}
}
