package replicas_test

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/replicas"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// replica is one process of a service: a node table served on ip:port.
type replica struct {
	tb   *nodes.Table
	stop func()
}

// serveOn serves a node table on ip:port (port 0: any).
func serveOn(t *testing.T, ip string, port int) (*replica, int) {
	t.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
	if err != nil {
		t.Fatal(err)
	}
	r := &replica{tb: nodes.New(0)}
	s := grpc.NewServer()
	meshv1.RegisterNodeReportServiceServer(s, &nodes.Server{Table: r.tb})
	go func() { _ = s.Serve(lis) }()
	r.stop = s.Stop
	t.Cleanup(s.Stop)
	return r, lis.Addr().(*net.TCPAddr).Port
}

func dial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// Two replicas behind one name, as a headless Service: a cancel reaches the run's nodes
// on both, a list holds both replicas' nodes, a node whose attempts ran on both sums
// their tokens under its latest attempt, and the list is settled only once both are.
func TestNodeReportsReachEveryReplica(t *testing.T) {
	a, port := serveOn(t, "127.0.0.1", 0)
	b, _ := serveOn(t, "127.0.0.2", port)
	var lookups atomic.Int32
	set, err := replicas.New("dns:///toolrunner.test:"+strconv.Itoa(port), dial, replicas.WithLookup(func(_ context.Context, host string) ([]string, error) {
		lookups.Add(1)
		if host != "toolrunner.test" {
			return nil, errors.New("unknown host")
		}
		return []string{"127.0.0.2", "127.0.0.1"}, nil
	}), replicas.WithRefresh(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = set.Close() }()
	c := replicas.NodeReports(set)
	ctx, stop := context.WithTimeout(t.Context(), 10*time.Second)
	defer stop()

	tool := meshv1.NodeKind_NODE_KIND_TOOL
	// Running nodes as executors begin them: each with a context the cancel ends.
	t0, _ := a.tb.Begin(ctx, "r", &meshv1.Node{Id: "root/s0.t0", Kind: tool, Name: "sleep"})
	t1, _ := b.tb.Begin(ctx, "r", &meshv1.Node{Id: "root/s0.t1", Kind: tool, Name: "sleep"})
	// root/s0.t2's first attempt ran on a, its second runs on b.
	a.tb.Start("r", &meshv1.Node{Id: "root/s0.t2", Kind: tool, Name: "sleep", Attempt: 1})
	a.tb.Update("r", "root/s0.t2", func(n *meshv1.Node) { n.Tokens = 5 })
	a.tb.End("r", "root/s0.t2", meshv1.NodeStatus_NODE_STATUS_FAILED, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED, "UNAVAILABLE", "x", nil)
	t2, _ := b.tb.Begin(ctx, "r", &meshv1.Node{Id: "root/s0.t2", Kind: tool, Name: "sleep", Attempt: 2})
	b.tb.Update("r", "root/s0.t2", func(n *meshv1.Node) { n.Tokens = 7 })

	list, err := c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]*meshv1.Node{}
	for _, n := range list.GetNodes() {
		ids[n.GetId()] = n
	}
	if len(ids) != 3 || ids["root/s0.t0"] == nil || ids["root/s0.t1"] == nil {
		t.Fatalf("listed %v, want the nodes of both replicas", list.GetNodes())
	}
	if n := ids["root/s0.t2"]; n.GetAttempt() != 2 || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING || n.GetTokens() != 12 {
		t.Errorf("a node on both replicas = %v, want attempt 2's record, running, with 5+7 tokens", n)
	}
	if list.GetSettled() {
		t.Error("settled while nodes run")
	}

	resp, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", NodePrefixes: []string{"root"}, Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR})
	if err != nil || resp.GetCancelled() != 3 {
		t.Fatalf("CancelNodes = %v, %v; want the 3 running nodes of both replicas", resp, err)
	}
	for _, c := range []context.Context{t0, t1, t2} {
		if !errors.Is(context.Cause(c), cancel.ErrOperator) {
			t.Errorf("a node's context: cause %v, want operator", context.Cause(c))
		}
	}
	// The executors end their cancelled nodes; then the list settles.
	for _, e := range []struct {
		r  *replica
		id string
	}{{a, "root/s0.t0"}, {b, "root/s0.t1"}, {b, "root/s0.t2"}} {
		e.r.tb.End("r", e.id, meshv1.NodeStatus_NODE_STATUS_CANCELLED, cancel.FromError(cancel.ErrOperator), "", "", nil)
	}
	list, err = c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r", SettleTimeout: durationpb.New(time.Second)})
	if err != nil || !list.GetSettled() {
		t.Fatalf("after every node ended: settled %v, %v", list.GetSettled(), err)
	}
	if n := lookups.Load(); n != 1 {
		t.Errorf("%d lookups within the refresh period, want 1", n)
	}

	// A replica that is down is left out; the answer is then not settled.
	b.stop()
	list, err = c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"})
	if err != nil || list.GetSettled() || len(list.GetNodes()) != 2 {
		t.Fatalf("with b down: %d nodes, settled %v, %v; want a's 2, not settled", len(list.GetNodes()), list.GetSettled(), err)
	}
	a.stop()
	if _, err := c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"}); err == nil {
		t.Fatal("with every replica down: no error")
	}
}

// Resolution: a failed lookup keeps the last addresses, a changed answer drops the
// connections of addresses gone; a target that is not dns:/// is one replica; bad
// targets are refused.
func TestSetResolution(t *testing.T) {
	var answer atomic.Pointer[[]string]
	answer.Store(&[]string{"127.0.0.1", "127.0.0.2"})
	var fail atomic.Bool
	set, err := replicas.New("dns:///svc.test:7702", dial, replicas.WithRefresh(time.Nanosecond),
		replicas.WithLookup(func(context.Context, string) ([]string, error) {
			if fail.Load() {
				return nil, errors.New("SERVFAIL")
			}
			return *answer.Load(), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = set.Close() }()
	targets := func() []string {
		var out []string
		for _, c := range set.Conns(t.Context()) {
			out = append(out, c.Target())
		}
		return out
	}
	if got := targets(); len(got) != 2 || got[0] != "127.0.0.1:7702" || got[1] != "127.0.0.2:7702" {
		t.Fatalf("conns to %v", got)
	}
	// Later resolutions run in the background: a few calls see each answer take effect.
	settled := func(want ...string) []string {
		var got []string
		for range 200 {
			if got = targets(); slices.Equal(got, want) {
				return got
			}
			time.Sleep(time.Millisecond)
		}
		return got
	}
	fail.Store(true)
	for range 20 {
		if got := targets(); len(got) != 2 {
			t.Fatalf("after a failed lookup: %v, want the last good addresses", got)
		}
		time.Sleep(time.Millisecond)
	}
	answer.Store(&[]string{"127.0.0.2"})
	fail.Store(false)
	if got := settled("127.0.0.2:7702"); len(got) != 1 || got[0] != "127.0.0.2:7702" {
		t.Fatalf("after the answer shrank: %v", got)
	}

	one, err := replicas.New("127.0.0.1:7702", dial)
	if err != nil {
		t.Fatal(err)
	}
	if got := one.Conns(t.Context()); len(got) != 1 || got[0].Target() != "127.0.0.1:7702" {
		t.Fatalf("a plain address: %v", got)
	}
	_ = one.Close()
	if got := one.Conns(t.Context()); len(got) != 0 {
		t.Errorf("conns after Close: %d", len(got))
	}
	for _, bad := range []string{"", "dns:///nohost", "dns://8.8.8.8/svc:1", "dns:///:7702", "dns://svc:1", "dns://no-port/svc:1"} {
		if _, err := replicas.New(bad, dial); err == nil {
			t.Errorf("target %q accepted", bad)
		}
	}
}

// Once the name has an answer, no caller waits for DNS: while a lookup hangs, every
// caller (the one whose call started it too) gets the last addresses at once. One
// lookup runs at a time, bounded by LookupTimeout, and Close stops it.
func TestSlowLookupHoldsNoOneUp(t *testing.T) {
	release := make(chan struct{})
	var calls, ended atomic.Int32
	set, err := replicas.New("dns:///svc.test:7702", dial, replicas.WithRefresh(time.Nanosecond),
		replicas.WithLookup(func(ctx context.Context, _ string) ([]string, error) {
			if calls.Add(1) == 1 {
				return []string{"127.0.0.1"}, nil
			}
			defer ended.Add(1)
			select { // later lookups hang until released or timed out
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return []string{"127.0.0.1"}, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	if got := set.Conns(t.Context()); len(got) != 1 {
		t.Fatalf("first resolution: %d conns", len(got))
	}
	// The next call starts a lookup that hangs; it and every call after it get the last
	// address at once, and start no second lookup.
	t0 := time.Now()
	for range 50 {
		if got := set.Conns(t.Context()); len(got) != 1 || got[0].Target() != "127.0.0.1:7702" {
			t.Fatalf("during a hung lookup: %v, want the last address", got)
		}
	}
	if d := time.Since(t0); d > replicas.LookupTimeout/2 {
		t.Errorf("50 calls took %v during a hung lookup: a caller waited for DNS", d)
	}
	for wait := time.Now().Add(replicas.LookupTimeout / 2); calls.Load() < 2 && time.Now().Before(wait); {
		time.Sleep(time.Millisecond) // the background lookup may not have begun yet
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("%d lookups, want the first and one hung one", n)
	}
	// The hung lookup gives up after LookupTimeout; a call after that starts another.
	deadline := time.Now().Add(10 * replicas.LookupTimeout)
	for ended.Load() < 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if ended.Load() < 1 {
		t.Fatalf("the hung lookup did not end within %v", 10*replicas.LookupTimeout)
	}
	if d := time.Since(t0); d < replicas.LookupTimeout/2 {
		t.Errorf("the hung lookup ended after %v, want about LookupTimeout (%v)", d, replicas.LookupTimeout)
	}
	for calls.Load() < 3 && time.Now().Before(deadline) {
		set.Conns(t.Context())
		time.Sleep(10 * time.Millisecond)
	}
	if calls.Load() < 3 {
		t.Fatal("no lookup after the hung one timed out")
	}
	// Close stops the third, hanging lookup and waits for it (goleak checks).
	t0 = time.Now()
	_ = set.Close()
	if d := time.Since(t0); d > replicas.LookupTimeout/2 {
		t.Errorf("Close took %v: it did not stop the lookup under way", d)
	}
	close(release)
}
