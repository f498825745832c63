package e2e

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/dnsstub"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// serveDNS answers A queries for name with ips (and nothing else) on a UDP port of
// 127.0.0.1, until the test ends: the name server of a headless Service, whose name
// resolves to every ready pod. It returns the server's address.
func serveDNS(t *testing.T, name string, ips ...string) string {
	t.Helper()
	s, err := dnsstub.Start(t.Context(), map[string][]string{name: ips})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s.Addr()
}

// Two toolrunner replicas behind one DNS name (127.0.0.1:P and 127.0.0.2:P, as two pods
// of a headless Service): the orchestrator's tool calls are spread over both, and a run's
// summary, its live view and its cancel reach the nodes on both (package mesh/replicas).
func TestReplicasAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "curfew-replicas-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(ctx, dir, "sqlite://"+filepath.Join(dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if !t.Failed() {
			_ = os.RemoveAll(dir)
		} else {
			t.Logf("process logs are in %s", dir)
		}
	})
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	dnsAddr := serveDNS(t, "toolrunner.curfew.test", "127.0.0.1", "127.0.0.2")
	target := "dns://" + dnsAddr + "/toolrunner.curfew.test:" + strconv.Itoa(port)

	model, err := c.Add(ctx, "modelproxy", "modelproxy", "--store", c.Store)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := c.Add(ctx, "subagent", "subagent", "--modelproxy", model.Addr, "--toolrunner", target)
	if err != nil {
		t.Fatal(err)
	}
	var tools []*meshproc.Proc
	for i, ip := range []string{"127.0.0.1", "127.0.0.2"} {
		p, err := c.AddAt(ctx, "toolrunner", "toolrunner-"+string(rune('a'+i)), net.JoinHostPort(ip, strconv.Itoa(port)), "--store", c.Store, "--subagent", sub.Addr)
		if err != nil {
			t.Fatal(err)
		}
		tools = append(tools, p)
	}
	orch, err := c.Add(ctx, "orchestrator", "orchestrator", "--store", c.Store, "--modelproxy", model.Addr, "--toolrunner", target, "--subagent", sub.Addr)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range append([]*meshproc.Proc{model, sub, orch}, tools...) {
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
	}
	cc, err := c.Conn(orch)
	if err != nil {
		t.Fatal(err)
	}
	oc := orchestratorv1.NewOrchestratorServiceClient(cc)
	// Each replica's own node table, read directly.
	own := func(p *meshproc.Proc, run string) []*meshv1.Node {
		t.Helper()
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := meshv1.NewNodeReportServiceClient(conn).ListNodes(ctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second)})
		if err != nil {
			t.Fatalf("%s ListNodes: %v", p.Name, err)
		}
		var tl []*meshv1.Node
		for _, n := range resp.GetNodes() {
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL {
				tl = append(tl, n)
			}
		}
		return tl
	}
	sleeps := func(ms int) string {
		tl := strings.TrimSuffix(strings.Repeat(`{"name": "sleep", "args": {"ms": `+strconv.Itoa(ms)+`}},`, 12), ",")
		return `{"tokens_per_second": 1000, "steps": [{"think_tokens": 1, "tools": [` + tl + `]}, {"answer_tokens": 1}]}`
	}

	// A first run connects the orchestrator to both replicas (connections are made at
	// the first call, and round_robin sends calls only to replicas already connected).
	if res, _ := runPlan(ctx, oc, sleeps(1), 60*time.Second, 0, false); res.err != nil {
		t.Fatalf("warm-up run: %v", res.err)
	}
	time.Sleep(200 * time.Millisecond)

	// A run whose 12 tools spread over both replicas: its summary holds all 12.
	res, _ := runPlan(ctx, oc, sleeps(200), 60*time.Second, 0, false)
	if res.err != nil {
		t.Fatalf("run: %v", res.err)
	}
	run := res.finished.GetRunId()
	summaryTools := 0
	for _, n := range res.finished.GetNodes() {
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			summaryTools++
		}
	}
	a, b := len(own(tools[0], run)), len(own(tools[1], run))
	if a == 0 || b == 0 || a+b != 12 {
		t.Fatalf("tools per replica %d and %d, want 12 spread over both (round_robin)", a, b)
	}
	if summaryTools != 12 {
		t.Fatalf("the summary lists %d succeeded tools, want all 12 of both replicas", summaryTools)
	}

	// A run cancelled while its 12 long tools run on both replicas: the live view shows
	// them all, CancelRun returns once both replicas' nodes ended, cancelled by the operator.
	start, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: sleeps(60_000), Timeout: durationpb.New(2 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	run = start.GetRun().GetRunId()
	for deadline := time.Now().Add(30 * time.Second); ; {
		got, err := oc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: run})
		if err != nil {
			t.Fatal(err)
		}
		running := 0
		for _, n := range got.GetRun().GetNodes() {
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				running++
			}
		}
		if running == 12 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the live view shows %d running tools, want all 12 of both replicas", running)
		}
		time.Sleep(100 * time.Millisecond)
	}
	cr, err := oc.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: run, Reason: "replicas test"})
	if err != nil {
		t.Fatal(err)
	}
	if cr.GetRun().GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("CancelRun = %v, want cancelled by the operator", cr.GetRun())
	}
	// The summary CancelRun returned holds the 12 tools of both replicas, each cancelled
	// by the operator (an executor that saw only the RST_STREAM gets the cause from the
	// orchestrator's note); each replica's own table has them ended.
	cancelled := 0
	for _, n := range cr.GetRun().GetNodes() {
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED &&
			n.GetCause() == meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
			cancelled++
		}
	}
	if cancelled != 12 {
		t.Errorf("the cancelled run's summary has %d tools cancelled by the operator, want 12:\n%s", cancelled, dump(cr.GetRun()))
	}
	total := 0
	for _, p := range tools {
		tl := own(p, run)
		total += len(tl)
		for _, n := range tl {
			if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetEndedAt() == nil {
				t.Errorf("%s: %s %v, want ended, cancelled", p.Name, n.GetId(), n.GetStatus())
			}
		}
		if len(tl) == 0 {
			t.Errorf("%s ran none of the cancelled run's tools", p.Name)
		}
	}
	if total != 12 {
		t.Errorf("the replicas hold %d tools of the cancelled run, want 12", total)
	}
}
