package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

const exitHeader = `Golden file: the exit codes of the documented cases (docs/cli.md "Exit codes: 0 success,
1 the run or call failed, 2 bad usage"; docs/deadletters.md; docs/providers.md "exit
code 2"; the services' usage errors), each run for real: "exit N" then, when the CLI
reported a failed call as "curfew: WHAT: CODE: ...", that gRPC CODE, else the status of
the summary 'curfew run --json' printed, else "-". The CLI
runs against the e2e mesh (mTLS) with HOME set to a temporary directory and no other
environment; $DATA, $PLAN_* and $BAD_* stand for temporary paths, $RUN for a run id
that does not exist and $CLOSED for a loopback address nothing listens on.
Rewrite with: go test ./e2e/ -run Golden -count=1 -update (and say why in the commit).`

// failedCall matches the CLI's report of a failed call: "curfew: get: NotFound: ...".
var failedCall = regexp.MustCompile(`(?m)^curfew(?: [a-z-]+)*: [a-z -]+: ([A-Z][A-Za-z]+): `)

// exitCase is one command line whose exit code is golden.
type exitCase struct {
	name string
	bin  string   // "curfew" or a service
	args []string // with $PLACEHOLDERS, replaced before the run
	env  []string // more environment, with $PLACEHOLDERS
}

// The CLI's and the services' exit codes in the documented cases are the golden ones.
// Each case's outcome does not depend on the other tests' runs on the shared mesh.
// outcome returns what the CLI said of a failed call (its gRPC code), else the status in
// the summary `curfew run --json` printed last, else "-".
func outcome(c exitCase, r execResult) string {
	if c.bin != "curfew" {
		return "-"
	}
	if m := failedCall.FindStringSubmatch(r.stderr); m != nil {
		return m[1]
	}
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	var last struct {
		Finished *struct {
			Status string `json:"status"`
		} `json:"finished"`
	}
	if json.Unmarshal([]byte(lines[len(lines)-1]), &last) == nil && last.Finished != nil {
		return last.Finished.Status
	}
	return "-"
}

func TestGoldenExitCodes(t *testing.T) {
	t.Parallel()
	bin := goldenBin(t)
	home, tmp := t.TempDir(), t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(tmp, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := l.Addr().String()
	_ = l.Close()
	vars := map[string]string{
		"$DATA":         mesh.Dir,
		"$PLAN_OK":      write("ok.json", `{"tokens_per_second": 1000, "steps": [{"think_tokens": 3, "tools": [{"name": "sleep", "args": {"ms": 10}}]}, {"answer_tokens": 2}]}`),
		"$PLAN_FAILS":   write("fails.json", `{"tokens_per_second": 1000, "steps": [{"tools": [{"name": "fail", "args": {"times": 100}}]}, {"answer_tokens": 1}]}`),
		"$PLAN_INVALID": write("invalid.json", `{"steps": [{"tools": [{"name": "sleep", "args": {"ms": 1}}]}]}`),
		"$PLAN_SLOW":    write("slow.json", `{"tokens_per_second": 40, "steps": [{"answer_tokens": 800}]}`),
		"$BAD_FIELD":    write("unknown-field.json", `{"providers": [{"name": "p", "base_url": "http://127.0.0.1:9/v1", "models": ["m"], "colour": "red"}]}`),
		"$BAD_DUPLICATE": write("duplicate.json", `{"providers": [{"name": "p", "base_url": "http://127.0.0.1:9/v1", "models": ["m"]},
		  {"name": "p", "base_url": "http://127.0.0.1:9/v1", "models": ["m"]}]}`),
		"$BAD_TOOLS": write("tools-inline-secret.json", `{"sources": [{"name": "gh", "kind": "mcp_http", "url": "https://mcp.example.com/mcp",
		  "headers": {"Authorization": "Bearer abc"}}]}`),
		"$RUN":    "00000000-0000-7000-8000-000000000000",
		"$CLOSED": closed,
	}
	cli := func(name string, args ...string) exitCase { return exitCase{name: name, bin: "curfew", args: args} }
	cases := []exitCase{
		// Usage errors: 2.
		cli("no command"),
		cli("unknown command", "frobnicate"),
		cli("unknown flag", "run", "--no-such-flag", "--data-dir", "$DATA"),
		cli("bad flag value", "run", "--deadline", "soon", "--plan", "$PLAN_OK", "--data-dir", "$DATA"),
		cli("run with neither plan nor task", "run", "--data-dir", "$DATA"),
		cli("get without a run", "get", "--data-dir", "$DATA"),
		cli("cancel without a run", "cancel", "--data-dir", "$DATA"),
		cli("trace without a run", "trace", "--data-dir", "$DATA"),
		cli("dlq unknown subcommand", "dlq", "frobnicate", "--data-dir", "$DATA"),
		cli("dlq show without an id", "dlq", "show", "--data-dir", "$DATA"),
		cli("dlq purge without a selection", "dlq", "purge", "--data-dir", "$DATA"),
		cli("tenant without a subcommand", "tenant"),
		cli("tenant create without a tenant", "tenant", "create", "--data-dir", "$DATA"),
		cli("tls init without a directory", "tls", "init"),
		// Success: 0.
		cli("help", "help"),
		cli("version", "version"),
		cli("run succeeded", "run", "--plan", "$PLAN_OK", "--deadline", "20s", "--json", "--data-dir", "$DATA"),
		cli("ls", "ls", "--limit", "1", "--data-dir", "$DATA"),
		cli("dlq ls", "dlq", "ls", "--limit", "1", "--data-dir", "$DATA"),
		// The run or the call failed: 1.
		cli("run failed", "run", "--plan", "$PLAN_FAILS", "--deadline", "20s", "--json", "--data-dir", "$DATA"),
		cli("run with an invalid plan", "run", "--plan", "$PLAN_INVALID", "--deadline", "20s", "--json", "--data-dir", "$DATA"),
		cli("run cancelled by its client", "run", "--plan", "$PLAN_SLOW", "--deadline", "20s", "--cancel-after", "300ms", "--json", "--data-dir", "$DATA"),
		cli("run past its deadline", "run", "--plan", "$PLAN_SLOW", "--deadline", "1s", "--json", "--data-dir", "$DATA"),
		cli("get an unknown run", "get", "$RUN", "--data-dir", "$DATA"),
		cli("cancel an unknown run", "cancel", "$RUN", "--data-dir", "$DATA"),
		cli("trace an unknown run", "trace", "$RUN", "--data-dir", "$DATA"),
		cli("dlq show an unknown dead letter", "dlq", "show", "$RUN", "--data-dir", "$DATA"),
		cli("dlq replay an unknown dead letter", "dlq", "replay", "$RUN", "--data-dir", "$DATA"),
		cli("orchestrator unreachable", "ls", "--addr", "$CLOSED", "--insecure", "--data-dir", "$DATA"),
		// modelproxy refuses a bad providers file with 2 (docs/providers.md).
		{name: "providers file with an unknown field", bin: "modelproxy", args: []string{"--insecure", "--providers-config", "$BAD_FIELD"}},
		{name: "providers file with a duplicate provider", bin: "modelproxy", args: []string{"--insecure", "--providers-config", "$BAD_DUPLICATE"}},
		{name: "providers file from the environment", bin: "modelproxy", args: []string{"--insecure"}, env: []string{"CURFEW_PROVIDERS_CONFIG=$BAD_FIELD"}},
		// toolrunner refuses a bad tools file with 2 (docs/tools.md).
		{name: "tools file with an inline secret", bin: "toolrunner", args: []string{"--insecure", "--tools-config", "$BAD_TOOLS"}},
	}
	// Every service refuses a bad command line or environment with 2 before it listens.
	for _, svc := range services {
		cases = append(cases,
			exitCase{name: svc + ": unknown flag", bin: svc, args: []string{"--insecure", "--no-such-flag"}},
			exitCase{name: svc + ": bad value in the environment", bin: svc, args: []string{"--insecure"}, env: []string{"CURFEW_MAX_DEADLINE=forever"}},
			exitCase{name: svc + ": neither --tls-dir nor --insecure", bin: svc},
		)
	}

	placeholder := regexp.MustCompile(`\$[A-Z_]+`)
	expand := func(s string) string {
		s = placeholder.ReplaceAllStringFunc(s, func(k string) string {
			v, ok := vars[k]
			if !ok {
				t.Fatalf("no value for %s", k)
			}
			return v
		})
		return s
	}
	var b strings.Builder
	for _, c := range cases {
		env := []string{"HOME=" + home}
		args := make([]string, len(c.args))
		for i, a := range c.args {
			args[i] = expand(a)
		}
		for _, e := range c.env {
			env = append(env, expand(e))
		}
		r := execBinary(t, bin, c.bin, env, time.Minute, args...)
		line := strings.Join(append(append(slices.Clone(c.env), c.bin), c.args...), " ")
		fmt.Fprintf(&b, "exit %d  %s  %s: $ %s\n", r.code, outcome(c, r), c.name, line)
		if testing.Verbose() {
			t.Logf("%s: exit %d\nstdout: %s\nstderr: %s", c.name, r.code, r.stdout, r.stderr)
		}
	}
	golden(t, "exitcodes.txt", exitHeader, b.String())
}
