package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMainUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		out  string
	}{
		{nil, ExitUsage, "Usage:"},
		{[]string{"help"}, ExitOK, "curfew up"},
		{[]string{"version"}, ExitOK, "curfew dev"},
		{[]string{"launch"}, ExitUsage, `unknown command "launch"`},
		{[]string{"get"}, ExitUsage, "give one RUN id"},
		{[]string{"get", "a", "b"}, ExitUsage, "give one RUN id"},
		{[]string{"ls", "extra"}, ExitUsage, "takes no arguments"},
		{[]string{"ls", "--since", "yesterday"}, ExitUsage, `--since "yesterday": give a duration`},
		{[]string{"ls", "--until", "-1h"}, ExitUsage, "--until -1h: give a positive duration"},
		{[]string{"ls", "--since", "10m", "--until", "1h"}, ExitUsage, "--since is after --until"},
		{[]string{"cancel"}, ExitUsage, "give one RUN id"},
		{[]string{"run"}, ExitUsage, "give --plan FILE or a TASK"},
		{[]string{"run", "--plan", "x.json", "task"}, ExitUsage, "not both"},
		{[]string{"run", "--plan", "/nonexistent/plan.json"}, ExitUsage, "--plan"},
		{[]string{"run", "--deadline", "0s", "{}"}, ExitUsage, "--deadline must be positive"},
		{[]string{"up", "--base-port", "-1"}, ExitUsage, "--base-port"},
		{[]string{"up", "--bogus"}, ExitUsage, "flag provided but not defined"},
	} {
		var out, errb bytes.Buffer
		code := Main(context.Background(), tc.args, nil, &out, &errb)
		if code != tc.code {
			t.Errorf("%q: exit %d, want %d (stderr %q)", tc.args, code, tc.code, errb.String())
		}
		if !strings.Contains(out.String()+errb.String(), tc.out) {
			t.Errorf("%q: output %q lacks %q", tc.args, out.String()+errb.String(), tc.out)
		}
	}
}

func TestParseInterspersed(t *testing.T) {
	fs := newFlags("x", &bytes.Buffer{})
	j := fs.Bool("json", false, "")
	d := fs.Duration("deadline", 0, "")
	pos, err := parse(fs, []string{"RUN1", "--json", "RUN2", "--deadline", "3s"})
	if err != nil {
		t.Fatal(err)
	}
	if !*j || *d != 3*time.Second || strings.Join(pos, ",") != "RUN1,RUN2" {
		t.Errorf("json=%v deadline=%v pos=%v", *j, *d, pos)
	}
}

func TestOrchestratorAddr(t *testing.T) {
	dir := t.TempDir()
	c := common{dataDir: dir}
	if got := c.orchestratorAddr(); got != "127.0.0.1:7700" {
		t.Errorf("no endpoints: %s", got)
	}
	if err := os.WriteFile(filepath.Join(dir, EndpointsFile), []byte(`{"services":{"orchestrator":{"addr":"127.0.0.1:9999"}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := c.orchestratorAddr(); got != "127.0.0.1:9999" {
		t.Errorf("from endpoints.json: %s", got)
	}
	c.addr = "10.0.0.1:1"
	if got := c.orchestratorAddr(); got != "10.0.0.1:1" {
		t.Errorf("--addr must win: %s", got)
	}
	if err := os.WriteFile(filepath.Join(dir, EndpointsFile), []byte(`{`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readEndpoints(dir); err == nil || !strings.Contains(err.Error(), EndpointsFile) {
		t.Errorf("a broken endpoints file must be reported by name: %v", err)
	}
}

func TestPrintSummary(t *testing.T) {
	now := time.Now()
	r := &orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		Cause: meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT, Deadline: timestamppb.New(now.Add(time.Second)),
		CancelledAt: timestamppb.New(now), Tokens: 41, TokensAfterCancel: 1, PromptTokens: 9, ErrorCode: "CANCELLED", ErrorMessage: "client disconnected",
		Nodes: []*meshv1.Node{
			{Id: "root", Kind: meshv1.NodeKind_NODE_KIND_RUN, Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED, Cause: meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT},
			{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL, Status: meshv1.NodeStatus_NODE_STATUS_SUCCEEDED, Tokens: 40, TokensAtCancel: 40},
			{Id: "root/s0.t0", Kind: meshv1.NodeKind_NODE_KIND_TOOL, Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED,
				Cleanup: &meshv1.Cleanup{Action: "abort deploy job 1", Completed: true, StartedAt: timestamppb.New(now), EndedAt: timestamppb.New(now.Add(300 * time.Millisecond))}},
		}}
	var b bytes.Buffer
	printSummary(&b, r)
	out := b.String()
	for _, want := range []string{"run r1  cancelled (cause client_disconnect)", "tokens 41   tokens after cancel 1   prompt tokens 9",
		"root/m0", "succeeded         -", `cleanup "abort deploy job 1" completed in 300ms`} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if exitFor(r) != ExitFail || exitFor(&orchestratorv1.Run{Status: orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED}) != ExitOK {
		t.Error("exit codes: only a succeeded run exits 0")
	}
}
