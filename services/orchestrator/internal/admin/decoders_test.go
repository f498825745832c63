package admin

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// fakeProxy is one modelproxy replica's decoder side.
type fakeProxy struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	replica  string
	decoders []*modelproxyv1.Decoder
	coord    []*modelproxyv1.Coordination
	cancels  []*modelproxyv1.CancelDecodersRequest
}

func (f *fakeProxy) ListDecoders(context.Context, *modelproxyv1.ListDecodersRequest) (*modelproxyv1.ListDecodersResponse, error) {
	return &modelproxyv1.ListDecodersResponse{Replica: f.replica, Decoders: f.decoders,
		Breakers:     []*modelproxyv1.ProviderBreaker{{Provider: "openai", State: "half_open"}},
		Coordination: f.coord}, nil
}

func (f *fakeProxy) CancelDecoders(_ context.Context, req *modelproxyv1.CancelDecodersRequest) (*modelproxyv1.CancelDecodersResponse, error) {
	f.cancels = append(f.cancels, req)
	return &modelproxyv1.CancelDecodersResponse{Replica: f.replica, Cancelled: f.decoders}, nil
}

type conns []*grpc.ClientConn

func (c conns) Conns(context.Context) []*grpc.ClientConn { return c }

func serveProxy(t *testing.T, f *fakeProxy) *grpc.ClientConn {
	return meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, f)
	})
}

func TestLeasesFanOutToEveryReplica(t *testing.T) {
	now := time.Now()
	dec := func(replica, run string, age time.Duration) *modelproxyv1.Decoder {
		return &modelproxyv1.Decoder{Replica: replica, Tenant: "acme", RunId: run, NodeId: "root/m0", Model: "sim", Provider: "sim",
			StartedAt: timestamppb.New(now.Add(-age)), Tokens: 5}
	}
	a := &fakeProxy{replica: "mp-a", decoders: []*modelproxyv1.Decoder{dec("mp-a", "r1", time.Second)}}
	b := &fakeProxy{replica: "mp-b", decoders: []*modelproxyv1.Decoder{dec("mp-b", "r2", time.Minute)},
		coord: []*modelproxyv1.Coordination{
			{Service: "modelproxy", Replica: "mp-b", Part: PartBudget, Degraded: true, Detail: "store unreachable", Since: timestamppb.New(now)},
			{Service: "modelproxy", Replica: "mp-b", Part: PartBreakerProbe, Target: "openai", Held: true, Detail: "probe out"},
		}}
	dead, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = dead.Close() }()
	st := storetest.OpenMemory(t)
	s := New(Config{Store: st, Decoders: conns{serveProxy(t, a), serveProxy(t, b), dead}, Log: slog.New(slog.DiscardHandler)})
	ctx := context.Background()

	ls, err := s.ListLeases(ctx, &adminv1.ListLeasesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ls.GetLeases()) != 2 || ls.GetLeases()[0].GetRunId() != "r2" || ls.GetLeases()[1].GetReplica() != "mp-a" {
		t.Fatalf("leases %v, want both replicas', oldest first", ls.GetLeases())
	}
	if age := ls.GetLeases()[0].GetAge().AsDuration(); age < time.Minute || age > time.Minute+30*time.Second {
		t.Errorf("the oldest lease's age is %v, want about 1m", age)
	}
	if len(ls.GetUnreachable()) != 1 || !strings.HasPrefix(ls.GetUnreachable()[0], "modelproxy 127.0.0.1:1") {
		t.Errorf("unreachable %v, want the dead replica named", ls.GetUnreachable())
	}
	v := s.fleet(ctx, 0)
	leases, breakers, unreachable := v.leases, v.breakers, v.unreachable
	if len(leases) != 2 || len(breakers) != 2 || breakers[0].GetService() != "modelproxy" || breakers[0].GetReplica() != "mp-a" ||
		breakers[0].GetTarget() != "openai" || breakers[0].GetState() != "half_open" || len(unreachable) != 1 {
		t.Errorf("fleet = %v, %v, %v", leases, breakers, unreachable)
	}
	// mp-b's coordinated limits come through, by part: the degraded budget as degraded.
	if c := v.coordination; len(c) != 2 || c[0].GetPart() != PartBreakerProbe || !c[0].GetHeld() ||
		c[1].GetPart() != PartBudget || !c[1].GetDegraded() || c[1].GetDetail() != "store unreachable" ||
		c[1].GetService() != "modelproxy" || c[1].GetReplica() != "mp-b" || !c[1].GetSince().AsTime().Equal(now.Truncate(0)) {
		t.Errorf("coordination %v, want mp-b's probe lease held and its budget degraded", c)
	}

	for _, bad := range []*durationpb.Duration{nil, durationpb.New(0), durationpb.New(-time.Second)} {
		_, err := s.CancelLeases(ctx, &adminv1.CancelLeasesRequest{OlderThan: bad})
		meshtest.WantCode(t, err, codes.InvalidArgument, "older_than")
	}
	cr, err := s.CancelLeases(ctx, &adminv1.CancelLeasesRequest{OlderThan: durationpb.New(30 * time.Second), Reason: "grace"})
	if err != nil {
		t.Fatal(err)
	}
	if len(cr.GetCancelled()) != 2 || len(cr.GetUnreachable()) != 1 || len(a.cancels) != 1 || a.cancels[0].GetOlderThan().AsDuration() != 30*time.Second || a.cancels[0].GetReason() != "grace" {
		t.Errorf("CancelLeases = %v; replica a got %v", cr, a.cancels)
	}
	wantAudit(t, st, "CancelLeases", "grace")
}

// wantAudit checks the newest audit entry of action has reason.
func wantAudit(t *testing.T, st store.Store, action, reason string) {
	t.Helper()
	es, _, err := st.ListAudit(context.Background(), store.AuditQuery{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if e.Action == action {
			if e.Reason != reason {
				t.Errorf("audit %s reason %q, want %q", action, e.Reason, reason)
			}
			return
		}
	}
	t.Errorf("no audit entry %s in %v", action, es)
}

func TestFreezesAndDrains(t *testing.T) {
	st := storetest.OpenMemory(t)
	s := New(Config{Store: st, Log: slog.New(slog.DiscardHandler)})
	ctx := context.Background()
	mk := func(tenant, id string) {
		t.Helper()
		if _, _, err := st.CreateRun(ctx, store.NewRun{Tenant: tenant, RunID: id, Task: []byte("t"), Model: "sim", Deadline: time.Now().Add(time.Hour)}); err != nil {
			t.Fatal(err)
		}
	}
	mk("acme", "run-unique")
	mk("globex", "run-other")

	for _, tc := range []struct {
		req  *adminv1.FreezeLedgerRequest
		code codes.Code
		msg  string
	}{
		{&adminv1.FreezeLedgerRequest{}, codes.InvalidArgument, "run_id or tenant is required"},
		{&adminv1.FreezeLedgerRequest{Tenant: "a b"}, codes.InvalidArgument, "tenant"},
		{&adminv1.FreezeLedgerRequest{RunId: "a/b"}, codes.InvalidArgument, "run_id"},
		{&adminv1.FreezeLedgerRequest{RunId: "run-other", Tenant: "acme"}, codes.NotFound, "no run run-other of tenant acme"},
		{&adminv1.FreezeLedgerRequest{RunId: "run-none"}, codes.NotFound, "run_id run-none"},
	} {
		_, err := s.FreezeLedger(ctx, tc.req)
		meshtest.WantCode(t, err, tc.code, tc.msg)
	}
	f, err := s.FreezeLedger(ctx, &adminv1.FreezeLedgerRequest{RunId: "run-unique", Reason: "leak"})
	if err != nil {
		t.Fatal(err)
	}
	if f.GetFreeze().GetTenant() != "acme" || f.GetFreeze().GetRunId() != "run-unique" || f.GetFreeze().GetTokensAfterFreeze() != 0 {
		t.Fatalf("freeze %v, want run-unique of acme (resolved)", f)
	}
	// Repeating keeps the first decision's instant.
	again, err := s.FreezeLedger(ctx, &adminv1.FreezeLedgerRequest{RunId: "run-unique", Tenant: "acme", Reason: "still"})
	if err != nil || !again.GetFreeze().GetFrozenAt().AsTime().Equal(f.GetFreeze().GetFrozenAt().AsTime()) || again.GetFreeze().GetReason() != "still" {
		t.Fatalf("the repeated freeze = %v, %v", again, err)
	}
	if _, err := s.FreezeLedger(ctx, &adminv1.FreezeLedgerRequest{Tenant: "globex"}); err != nil {
		t.Fatal(err)
	}
	// The orphan tokens recorded after the freeze are counted; the output a decoder
	// made before it, written when it ended, is not. The store keeps milliseconds and
	// counts what was recorded strictly after the freeze's: they come a millisecond on.
	time.Sleep(2 * time.Millisecond)
	if _, err := st.AddTokens(ctx, store.LedgerEntry{Tenant: "acme", RunID: "run-unique", NodeID: "root/m0", Tokens: 4, Kind: "orphan", Key: "k1"},
		store.LedgerEntry{Tenant: "acme", RunID: "run-unique", NodeID: "root/m0", Tokens: 9, Kind: "output", Key: "k2"}); err != nil {
		t.Fatal(err)
	}
	lf, err := s.ListFreezes(ctx, &adminv1.ListFreezesRequest{})
	if err != nil || len(lf.GetFreezes()) != 2 {
		t.Fatalf("ListFreezes = %v, %v", lf, err)
	}
	for _, fr := range lf.GetFreezes() {
		if fr.GetRunId() == "run-unique" && fr.GetTokensAfterFreeze() != 4 {
			t.Errorf("the run's freeze reports %d tokens after it, want 4", fr.GetTokensAfterFreeze())
		}
	}
	th, err := s.ThawLedger(ctx, &adminv1.ThawLedgerRequest{RunId: "run-unique", Reason: "fixed"})
	if err != nil || !th.GetThawed() {
		t.Fatalf("thaw = %v, %v", th, err)
	}
	if th, err := s.ThawLedger(ctx, &adminv1.ThawLedgerRequest{RunId: "run-unique", Tenant: "acme"}); err != nil || th.GetThawed() {
		t.Fatalf("a second thaw = %v, %v; want thawed false", th, err)
	}
	wantAudit(t, st, "ThawLedger", "")

	_, err = s.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{Pool: "no pool"})
	meshtest.WantCode(t, err, codes.InvalidArgument, "pool")
	_, err = s.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{CancelAfter: durationpb.New(-time.Second)})
	meshtest.WantCode(t, err, codes.InvalidArgument, "cancel_after")
	d, err := s.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{Pool: "overflow", CancelAfter: durationpb.New(time.Minute), Reason: "rollback"})
	if err != nil || d.GetDrain().GetPool() != "overflow" || d.GetDrain().GetCancelAt() == nil {
		t.Fatalf("drain = %v, %v", d, err)
	}
	all, err := s.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{})
	if err != nil || all.GetDrain().GetPool() != "" || all.GetDrain().GetCancelAt() != nil {
		t.Fatalf("drain of every run = %v, %v", all, err)
	}
	cs, err := st.ListControls(ctx)
	if err != nil {
		t.Fatal(err)
	}
	drains := 0
	for _, c := range cs {
		if c.Kind == store.ControlDrain && (c.Target == "overflow" && !c.Until.IsZero() || c.Target == store.DrainAll && c.Until.IsZero()) {
			drains++
		}
	}
	if drains != 2 {
		t.Errorf("controls %v, want the two drains", cs)
	}
	wantAudit(t, st, "DrainDecoders", "")
	u, err := s.UndrainDecoders(ctx, &adminv1.UndrainDecodersRequest{Pool: "overflow", Reason: "done"})
	if err != nil || !u.GetUndrained() {
		t.Fatalf("undrain = %v, %v", u, err)
	}
	if u, err := s.UndrainDecoders(ctx, &adminv1.UndrainDecodersRequest{Pool: "overflow"}); err != nil || u.GetUndrained() {
		t.Fatalf("a second undrain = %v, %v", u, err)
	}
}
