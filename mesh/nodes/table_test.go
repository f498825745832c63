package nodes_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	running   = meshv1.NodeStatus_NODE_STATUS_RUNNING
	succeeded = meshv1.NodeStatus_NODE_STATUS_SUCCEEDED
	failed    = meshv1.NodeStatus_NODE_STATUS_FAILED
	cancelled = meshv1.NodeStatus_NODE_STATUS_CANCELLED
	deadlined = meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED

	noCause  = meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
	sibling  = meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED
	operator = meshv1.CancelCause_CANCEL_CAUSE_OPERATOR
	deadline = meshv1.CancelCause_CANCEL_CAUSE_DEADLINE

	tool = meshv1.NodeKind_NODE_KIND_TOOL
)

func ids(ns []*meshv1.Node) []string {
	out := make([]string, len(ns))
	for i, n := range ns {
		out[i] = n.Id
	}
	return out
}

func start(tb *nodes.Table, run string, idList ...string) {
	for _, id := range idList {
		tb.Start(run, &meshv1.Node{Id: id, Kind: tool, Name: "sleep"})
	}
}

func TestTableLifecycle(t *testing.T) {
	tb := nodes.New(0)
	before := time.Now()
	got := tb.Start("r1", &meshv1.Node{Id: "root/s0.t0", Kind: tool, Name: "sleep", Status: succeeded})
	if got.Status != running || got.StartedAt == nil || got.StartedAt.AsTime().Before(before.Truncate(time.Microsecond)) {
		t.Fatalf("Start returned %v; want RUNNING with a start time", got)
	}
	got.Name = "mutated" // a copy: the table must not change
	if u := tb.Update("r1", "root/s0.t0", func(n *meshv1.Node) { n.Tokens = 7 }); u == nil || u.Name != "sleep" || u.Tokens != 7 {
		t.Fatalf("Update = %v; want name sleep, tokens 7", u)
	}
	if u := tb.Update("r1", "nope", func(*meshv1.Node) { t.Error("fn called for an unknown node") }); u != nil {
		t.Errorf("Update(unknown) = %v, want nil", u)
	}
	if u := tb.Update("r2", "root", func(*meshv1.Node) { t.Error("fn called for an unknown run") }); u != nil {
		t.Errorf("Update(unknown run) = %v", u)
	}
	end := tb.End("r1", "root/s0.t0", failed, noCause, "UNAVAILABLE", "tool broke", func(n *meshv1.Node) { n.Tokens++ })
	if end.Status != failed || end.ErrorCode != "UNAVAILABLE" || end.ErrorMessage != "tool broke" || end.EndedAt == nil || end.Tokens != 8 {
		t.Fatalf("End = %v", end)
	}
	if e := tb.End("r1", "missing", succeeded, noCause, "", "", nil); e != nil {
		t.Errorf("End(unknown) = %v, want nil", e)
	}
	ns, settled := tb.List(context.Background(), "r1", nil, 0)
	if !settled || len(ns) != 1 || ns[0].Status != failed || ns[0].Tokens != 8 {
		t.Fatalf("List = %v, %v", ns, settled)
	}
	if ns, settled := tb.List(context.Background(), "unknown-run", nil, time.Second); ns != nil || !settled {
		t.Errorf("List(unknown run) = %v, %v; want nothing, settled", ns, settled)
	}
	if runs := tb.Runs(); !slices.Equal(runs, []string{"r1"}) {
		t.Errorf("Runs = %v", runs)
	}
}

func TestListPrefixesAndOrder(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "root/s0.t10", "root/s0.t1/sub/m0", "root", "root/s0.t1", "root/m0", "rootx")
	tb.Note("r", "root/s0.t1", sibling, time.Now())
	start(tb, "other", "root/s0.t1")

	cases := []struct {
		prefixes []string
		want     []string
	}{
		{nil, []string{"root", "root/m0", "root/s0.t1", "root/s0.t1", "root/s0.t1/sub/m0", "root/s0.t10", "rootx"}},
		{[]string{"root/s0.t1"}, []string{"root/s0.t1", "root/s0.t1", "root/s0.t1/sub/m0"}},
		{[]string{"root/s0.t10", "root/m0"}, []string{"root/m0", "root/s0.t10"}},
		{[]string{"root/s0"}, []string{}},
		{[]string{"root"}, []string{"root", "root/m0", "root/s0.t1", "root/s0.t1", "root/s0.t1/sub/m0", "root/s0.t10"}},
	}
	for _, tc := range cases {
		ns, _ := tb.List(context.Background(), "r", tc.prefixes, 0)
		if got := ids(ns); !slices.Equal(got, tc.want) {
			t.Errorf("List(%q) = %q, want %q", tc.prefixes, got, tc.want)
		}
	}
	// The note is listed with the node it is about.
	ns, _ := tb.List(context.Background(), "r", []string{"root/s0.t1"}, 0)
	var notes int
	for _, n := range ns {
		if n.Kind == meshv1.NodeKind_NODE_KIND_UNSPECIFIED {
			notes++
			if n.Cause != sibling || n.CancelledAt == nil {
				t.Errorf("note = %v", n)
			}
		}
	}
	if notes != 1 {
		t.Errorf("got %d notes, want 1", notes)
	}
}

func TestSelected(t *testing.T) {
	cases := []struct {
		id       string
		prefixes []string
		want     bool
	}{
		{"anything", nil, true},
		{"root/s0.t1", []string{"root/s0.t1"}, true},
		{"root/s0.t1/sub/m0", []string{"root/s0.t1"}, true},
		{"root/s0.t10", []string{"root/s0.t1"}, false},
		{"root/s0.t1x/y", []string{"root/s0.t1"}, false},
		{"root", []string{"root/s0.t1"}, false},
		{"root/m0", []string{"root/s0.t1", "root/m0"}, true},
	}
	for _, tc := range cases {
		if got := nodes.Selected(tc.id, tc.prefixes); got != tc.want {
			t.Errorf("Selected(%q, %q) = %v, want %v", tc.id, tc.prefixes, got, tc.want)
		}
	}
	for id, want := range map[string]string{"root": "", "root/s0.t1": "root", "root/s0.t1/sub/m0": "root/s0.t1/sub"} {
		if got := nodes.Parent(id); got != want {
			t.Errorf("Parent(%q) = %q, want %q", id, got, want)
		}
	}
}

func TestNoteFirstWins(t *testing.T) {
	tb := nodes.New(0)
	t0 := time.Now()
	tb.Note("r", "root/s0.t1", sibling, t0)
	tb.Note("r", "root/s0.t1", operator, t0.Add(time.Second))
	ns, settled := tb.List(context.Background(), "r", nil, time.Second)
	if !settled || len(ns) != 1 || ns[0].Cause != sibling || !ns[0].CancelledAt.AsTime().Equal(t0) {
		t.Fatalf("List = %v, %v; want one note with the first cause", ns, settled)
	}
}

func TestListSettleWaitsForEnd(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "root/s0.t0", "root/s0.t0/sub", "root/s0.t1")
	const delay = 100 * time.Millisecond
	ended := make(chan time.Time, 1)
	go func() {
		time.Sleep(delay)
		tb.End("r", "root/s0.t0/sub", cancelled, noCause, "CANCELLED", "cancelled", nil)
		time.Sleep(delay / 2)
		ended <- time.Now()
		tb.End("r", "root/s0.t0", cancelled, noCause, "CANCELLED", "cancelled", nil)
	}()
	begin := time.Now()
	// root/s0.t1 keeps running: it is not selected and must not hold the wait.
	ns, settled := tb.List(context.Background(), "r", []string{"root/s0.t0"}, 5*time.Second)
	returned := time.Now()
	lastEnd := <-ended
	if !settled {
		t.Fatalf("settled = false; nodes %v", ns)
	}
	if returned.Before(lastEnd) || returned.Sub(begin) < delay {
		t.Fatalf("List returned after %v, before the last selected node ended", returned.Sub(begin))
	}
	for _, n := range ns {
		if n.Status != cancelled || n.EndedAt == nil {
			t.Errorf("node %s listed as %v, want ended", n.Id, n.Status)
		}
	}
	if got := ids(ns); !slices.Equal(got, []string{"root/s0.t0", "root/s0.t0/sub"}) {
		t.Errorf("listed %q", got)
	}
}

func TestListSettleTimeout(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "root/s0.t0", "root/s0.t1")
	tb.End("r", "root/s0.t1", succeeded, noCause, "", "", nil)
	const settle = 100 * time.Millisecond
	begin := time.Now()
	ns, settled := tb.List(context.Background(), "r", nil, settle)
	elapsed := time.Since(begin)
	if settled {
		t.Fatal("settled = true with a node still running")
	}
	if elapsed < settle || elapsed > settle+2*time.Second {
		t.Errorf("List waited %v, want about %v", elapsed, settle)
	}
	if len(ns) != 2 || ns[0].Status != running || ns[1].Status != succeeded {
		t.Errorf("List = %v; want the current state of both nodes", ns)
	}
	// Without settle it does not wait, and says whether all had ended.
	begin = time.Now()
	if _, settled := tb.List(context.Background(), "r", nil, 0); settled || time.Since(begin) > time.Second {
		t.Errorf("List without settle: settled=%v after %v", settled, time.Since(begin))
	}
	if _, settled := tb.List(context.Background(), "r", []string{"root/s0.t1"}, 0); !settled {
		t.Error("List of ended nodes only: settled = false")
	}
}

func TestListSettleEndsWithContext(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "root/s0.t0")
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	begin := time.Now()
	_, settled := tb.List(ctx, "r", nil, 30*time.Second)
	if settled {
		t.Fatal("settled = true with a node still running")
	}
	if elapsed := time.Since(begin); elapsed > 3*time.Second {
		t.Fatalf("List ignored ctx cancellation: waited %v", elapsed)
	}
}

func TestRestartCountsOnce(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "root/m0")
	start(tb, "r", "root/m0") // a retried attempt on the same node
	tb.End("r", "root/m0", succeeded, noCause, "", "", nil)
	if _, settled := tb.List(context.Background(), "r", nil, 0); !settled {
		t.Fatal("node started twice and ended once still counts as running")
	}
	tb.Sweep(time.Now().Add(nodes.DefaultRetention + time.Minute))
	if len(tb.Runs()) != 0 {
		t.Fatalf("run not swept after its only node ended: %v", tb.Runs())
	}
}

func TestSweep(t *testing.T) {
	const retention = time.Minute
	tb := nodes.New(retention)
	start(tb, "done", "root", "root/m0")
	tb.End("done", "root/m0", succeeded, noCause, "", "", nil)
	tb.End("done", "root", succeeded, noCause, "", "", nil)
	start(tb, "running", "root")
	start(tb, "partly", "root", "root/m0")
	tb.End("partly", "root/m0", succeeded, noCause, "", "", nil)
	now := time.Now()

	tb.Sweep(now.Add(retention / 2))
	if got := sorted(tb.Runs()); !slices.Equal(got, []string{"done", "partly", "running"}) {
		t.Fatalf("runs after a sweep within retention = %v; want all kept", got)
	}
	tb.Sweep(now.Add(retention + time.Second))
	if got := sorted(tb.Runs()); !slices.Equal(got, []string{"partly", "running"}) {
		t.Fatalf("runs after retention = %v; want the ended run forgotten, running ones kept", got)
	}
	tb.Sweep(now.Add(100 * retention))
	if got := sorted(tb.Runs()); !slices.Equal(got, []string{"partly", "running"}) {
		t.Fatalf("a run with a running node was swept: %v", got)
	}
	if ns, _ := tb.List(context.Background(), "done", nil, 0); ns != nil {
		t.Errorf("forgotten run still lists %v", ns)
	}
}

func sorted(s []string) []string { slices.Sort(s); return s }

// Many Lists wait at once (a teardown: every cancelled child's settle); each returns once
// its own selection has ended, and a node started while it waits holds it too.
func TestListSettleManyWaiters(t *testing.T) {
	tb := nodes.New(0)
	start(tb, "r", "a", "a/b", "c")
	type result struct {
		ns      []*meshv1.Node
		settled bool
	}
	wait := func(prefix string) chan result {
		c := make(chan result, 1)
		go func() {
			ns, settled := tb.List(context.Background(), "r", []string{prefix}, 5*time.Second)
			c <- result{ns, settled}
		}()
		return c
	}
	waitA, waitAB, waitC := wait("a"), wait("a/b"), wait("c")
	time.Sleep(50 * time.Millisecond) // let them register
	tb.End("r", "a/b", succeeded, noCause, "", "", nil)
	if r := <-waitAB; !r.settled || !slices.Equal(ids(r.ns), []string{"a/b"}) {
		t.Fatalf("List(a/b) = %q, %v", ids(r.ns), r.settled)
	}
	start(tb, "r", "a/d") // starts while List(a) waits: it must wait for it too
	tb.End("r", "a", succeeded, noCause, "", "", nil)
	select {
	case r := <-waitA:
		t.Fatalf("List(a) returned %q, %v while a/d runs", ids(r.ns), r.settled)
	case <-time.After(50 * time.Millisecond):
	}
	tb.End("r", "a/d", succeeded, noCause, "", "", nil)
	if r := <-waitA; !r.settled || !slices.Equal(ids(r.ns), []string{"a", "a/b", "a/d"}) {
		t.Fatalf("List(a) = %q, %v", ids(r.ns), r.settled)
	}
	select {
	case r := <-waitC:
		t.Fatalf("List(c) returned %q, %v while c runs", ids(r.ns), r.settled)
	default:
	}
	tb.End("r", "c", failed, noCause, "UNAVAILABLE", "down", nil)
	if r := <-waitC; !r.settled || len(r.ns) != 1 || r.ns[0].Status != failed {
		t.Fatalf("List(c) = %v, %v", r.ns, r.settled)
	}
}
