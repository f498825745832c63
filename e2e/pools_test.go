package e2e

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// opsCluster is a Cluster of two orchestrators on PostgreSQL with an operator's key:
// what the rollback order's tests act on.
type opsCluster struct {
	*meshproc.Cluster
	st       store.Store
	orchs    []*meshproc.Proc
	runs     []orchestratorv1.OrchestratorServiceClient
	admins   []adminv1.AdminServiceClient
	adminKey string
	model    *meshproc.Proc
}

// newOpsBase returns an empty cluster on a PostgreSQL store of its own, with an
// operator's key (admin scope) in it: the rollback order's tests add the processes.
func newOpsBase(ctx context.Context, t *testing.T, name string) *opsCluster {
	t.Helper()
	return newOpsBaseOn(ctx, t, name, storetest.PostgresDSN(t))
}

// newOpsBaseOn is newOpsBase on the PostgreSQL store dsn names.
func newOpsBaseOn(ctx context.Context, t *testing.T, name, dsn string) *opsCluster {
	t.Helper()
	c := newCluster(ctx, t, name, dsn)
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	k, err := apikey.New("ops")
	if err != nil {
		t.Fatal(err)
	}
	k.Record.Scopes = []string{store.ScopeAdmin}
	if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
		t.Fatal(err)
	}
	return &opsCluster{Cluster: c, st: st, adminKey: k.Secret}
}

// newOpsCluster starts the mesh with extra flags per service (as Cluster.Mesh takes
// them, plus "orchestrator") and two orchestrators.
func newOpsCluster(ctx context.Context, t *testing.T, name string, extra map[string][]string) *opsCluster {
	t.Helper()
	oc := newOpsBase(ctx, t, name)
	model, sub, tools, err := oc.Mesh(ctx, extra)
	if err != nil {
		t.Fatal(err)
	}
	oc.model = model
	for _, n := range []string{"orchestrator-a", "orchestrator-b"} {
		oc.addOrchestrator(ctx, t, n, oc.OrchestratorArgs(model, sub, tools, extra["orchestrator"]...)...)
	}
	return oc
}

// addOrchestrator starts an orchestrator with args and dials its run and admin APIs.
func (oc *opsCluster) addOrchestrator(ctx context.Context, t *testing.T, name string, args ...string) {
	t.Helper()
	p, err := oc.Add(ctx, "orchestrator", name, args...)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err := oc.Conn(p)
	if err != nil {
		t.Fatal(err)
	}
	adm, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(apikey.Bearer(oc.adminKey)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = adm.Close() })
	oc.orchs = append(oc.orchs, p)
	oc.runs = append(oc.runs, orchestratorv1.NewOrchestratorServiceClient(conn))
	oc.admins = append(oc.admins, adminv1.NewAdminServiceClient(adm))
}

// cli runs the curfew command against orchestrator i with the operator's key.
func (oc *opsCluster) cli(ctx context.Context, t *testing.T, i int, args ...string) (string, int) {
	t.Helper()
	cmd := exec.CommandContext(ctx, oc.Bin("curfew"), append(args, "--addr", oc.orchs[i].Addr, "--insecure")...)
	cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+oc.adminKey)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return out.String(), ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), 0
}

// sheddable starts a short sheddable run on orchestrator i and returns StartRun's error.
func (oc *opsCluster) sheddable(ctx context.Context, i int) error {
	ctx = metadata.AppendToOutgoingContext(ctx, md.Criticality, "sheddable")
	_, err := oc.runs[i].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: `{"steps":[{"answer_tokens":1}]}`, Timeout: durationpb.New(30 * time.Second)})
	return err
}

// shedCondition is the condition of a pool_closed shed, or "" when err is not one.
func shedCondition(err error) string {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == "SHED_POOL_CLOSED" {
			return ei.GetMetadata()["condition"]
		}
	}
	return ""
}

// waitFor polls ok every 50 ms until it holds or within passes, and returns how long it took.
func waitFor(t *testing.T, what string, within time.Duration, ok func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for ; time.Since(start) < within; time.Sleep(50 * time.Millisecond) {
		if ok() {
			return time.Since(start)
		}
	}
	t.Fatalf("%s: not within %v", what, within)
	return 0
}

// Issue 22's pools across replicas: a close issued to one orchestrator sheds the pool's
// runs on the other (pool_closed, condition operator) within its poll period; status
// on either shows who closed it and why; an open through the other admits again; a
// reopen waits until the orphan delta has stayed zero for its window, restarting the
// wait when orphan tokens arrive; the audit log lists each step with its reason.
func TestPoolCloseOpenReopenAcrossReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	oc := newOpsCluster(ctx, t, "pools", map[string][]string{"orchestrator": {"--operator-poll", "200ms"}})
	for i := range oc.orchs {
		if err := oc.sheddable(ctx, i); err != nil {
			t.Fatalf("%s: a sheddable run before any control: %v", oc.orchs[i].Name, err)
		}
	}

	out, code := oc.cli(ctx, t, 0, "pool", "close", "overflow", "--reason", "step 1: cancel path unproven")
	if code != 0 || !strings.Contains(out, "pool overflow closed") {
		t.Fatalf("curfew pool close: exit %d: %s", code, out)
	}
	took := waitFor(t, "orchestrator-b sheds the closed pool", 5*time.Second, func() bool {
		return shedCondition(oc.sheddable(ctx, 1)) == "operator"
	})
	if took > time.Second+500*time.Millisecond { // the "within a second", with the poll (200 ms) and margin
		t.Errorf("the close took %v to reach orchestrator-b", took)
	}
	if err := oc.sheddable(ctx, 0); shedCondition(err) != "operator" {
		t.Errorf("orchestrator-a after its own close: %v, want pool_closed (operator)", err)
	}
	// The paid pool is not touched.
	if _, err := oc.runs[1].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: `{"steps":[{"answer_tokens":1}]}`}); err != nil {
		t.Errorf("a critical run while overflow is closed: %v", err)
	}
	st, err := oc.admins[1].Status(ctx, &adminv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var overflow *adminv1.PoolState
	for _, p := range st.GetPools() {
		if p.GetPool() == "overflow" {
			overflow = p
		}
	}
	if overflow == nil || !overflow.GetOperatorClosed() || overflow.GetOperatorReason() != "step 1: cancel path unproven" ||
		!strings.HasPrefix(overflow.GetOperatorActor(), "key:") || overflow.GetReplica() != st.GetReplica() {
		t.Errorf("orchestrator-b's status of overflow: %v", overflow)
	}
	// Repeating the close is a no-op: the first decision's actor and time stand.
	if _, code := oc.cli(ctx, t, 1, "pool", "close", "overflow", "--reason", "again"); code != 0 {
		t.Error("repeating the close failed")
	}

	if _, err := oc.admins[1].OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: "overflow", Reason: "step 5 done by hand"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "orchestrator-a admits after the open", 5*time.Second, func() bool { return oc.sheddable(ctx, 0) == nil })

	// Reopen: orphan tokens arriving meanwhile restart the quiet period.
	if _, err := oc.admins[0].ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: "overflow", Reason: "again"}); err != nil {
		t.Fatal(err)
	}
	stream, err := oc.admins[1].ReopenPool(ctx, &adminv1.ReopenPoolRequest{Pool: "overflow", Reason: "orphans quiet",
		Window: durationpb.New(1500 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	var orphansAt time.Time
	var sawDelta bool
	for {
		rep, err := stream.Recv()
		if err != nil {
			t.Fatalf("ReopenPool: %v", err)
		}
		if orphansAt.IsZero() && time.Since(began) > 500*time.Millisecond {
			if _, err := oc.st.AddTokens(ctx, store.LedgerEntry{Tenant: "default", RunID: "r-orphan", NodeID: "root", Tokens: 7,
				Kind: store.KindOrphan, Key: "pools-e2e-orphan"}); err != nil {
				t.Fatal(err)
			}
			orphansAt = time.Now()
		}
		sawDelta = sawDelta || rep.GetOrphanDelta() == 7
		if !rep.GetOpened() {
			if shedCondition(oc.sheddable(ctx, 0)) != "operator" {
				t.Fatal("the pool admits while reopen still waits")
			}
			continue
		}
		if orphansAt.IsZero() || time.Since(orphansAt) < 1500*time.Millisecond || !sawDelta {
			t.Fatalf("opened %v after the orphans (at %v; delta seen %v), want at least the 1.5 s window after them",
				time.Since(orphansAt), orphansAt, sawDelta)
		}
		if rep.GetPool().GetOperatorClosed() {
			t.Errorf("opened, but the pool's state is %v", rep.GetPool())
		}
		break
	}
	waitFor(t, "orchestrator-a admits after the reopen", 5*time.Second, func() bool { return oc.sheddable(ctx, 0) == nil })

	// The audit log lists the steps with their reasons, newest first.
	audit, err := oc.admins[0].ListAudit(ctx, &adminv1.ListAuditRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range audit.GetEntries() {
		if strings.HasSuffix(e.GetAction(), "Pool") {
			got = append([]string{e.GetAction() + ": " + e.GetReason()}, got...)
		}
	}
	want := []string{"ClosePool: step 1: cancel path unproven", "ClosePool: again", "OpenPool: step 5 done by hand", "ClosePool: again", "ReopenPool: orphans quiet"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("audit of the pool steps, oldest first:\n got %q\nwant %q", got, want)
	}
}
