package cli

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// fakeAdmin answers the decoder side of the admin API and records the requests.
type fakeAdmin struct {
	adminv1.UnimplementedAdminServiceServer
	mu   sync.Mutex
	reqs []proto.Message
}

func (f *fakeAdmin) got(m proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs = append(f.reqs, m)
}

func (f *fakeAdmin) last() proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.reqs) == 0 {
		return nil
	}
	return f.reqs[len(f.reqs)-1]
}

var leaseStart = time.Now().Add(-90 * time.Second)

func testLease() *adminv1.Lease {
	return &adminv1.Lease{Replica: "mp-a", Tenant: "acme", RunId: "run-1", NodeId: "root/m0", Model: "sim", Provider: "sim",
		StartedAt: timestamppb.New(leaseStart), Age: durationpb.New(90 * time.Second), LastHeartbeat: timestamppb.New(leaseStart), Tokens: 42}
}

func (f *fakeAdmin) ListLeases(_ context.Context, req *adminv1.ListLeasesRequest) (*adminv1.ListLeasesResponse, error) {
	f.got(req)
	return &adminv1.ListLeasesResponse{Leases: []*adminv1.Lease{testLease()}, Unreachable: []string{"modelproxy 10.0.0.2:7706: connection refused"}}, nil
}

func (f *fakeAdmin) CancelLeases(_ context.Context, req *adminv1.CancelLeasesRequest) (*adminv1.CancelLeasesResponse, error) {
	f.got(req)
	return &adminv1.CancelLeasesResponse{Cancelled: []*adminv1.Lease{testLease()}}, nil
}

func (f *fakeAdmin) FreezeLedger(_ context.Context, req *adminv1.FreezeLedgerRequest) (*adminv1.FreezeLedgerResponse, error) {
	f.got(req)
	if req.GetRunId() == "ambiguous" {
		return nil, status.Error(codes.InvalidArgument, "run_id ambiguous names a run of several tenants")
	}
	return &adminv1.FreezeLedgerResponse{Freeze: &adminv1.Freeze{Tenant: "acme", RunId: req.GetRunId(), FrozenAt: timestamppb.New(leaseStart), TokensAfterFreeze: 3}}, nil
}

func (f *fakeAdmin) ThawLedger(_ context.Context, req *adminv1.ThawLedgerRequest) (*adminv1.ThawLedgerResponse, error) {
	f.got(req)
	return &adminv1.ThawLedgerResponse{Thawed: true}, nil
}

func (f *fakeAdmin) ListFreezes(_ context.Context, req *adminv1.ListFreezesRequest) (*adminv1.ListFreezesResponse, error) {
	f.got(req)
	return &adminv1.ListFreezesResponse{Freezes: []*adminv1.Freeze{{Tenant: "acme", RunId: "run-1", Actor: "mesh:curfew-cli", FrozenAt: timestamppb.New(leaseStart), TokensAfterFreeze: 7, Reason: "leak"}}}, nil
}

func (f *fakeAdmin) DrainDecoders(_ context.Context, req *adminv1.DrainDecodersRequest) (*adminv1.DrainDecodersResponse, error) {
	f.got(req)
	d := &adminv1.Drain{Pool: req.GetPool(), StartedAt: timestamppb.Now()}
	if req.GetCancelAfter() != nil {
		d.CancelAt = timestamppb.New(time.Now().Add(req.GetCancelAfter().AsDuration()))
	}
	return &adminv1.DrainDecodersResponse{Drain: d}, nil
}

func (f *fakeAdmin) UndrainDecoders(_ context.Context, req *adminv1.UndrainDecodersRequest) (*adminv1.UndrainDecodersResponse, error) {
	f.got(req)
	return &adminv1.UndrainDecodersResponse{Undrained: req.GetPool() == "overflow"}, nil
}

func serveAdmin(t *testing.T) (*fakeAdmin, []string) {
	t.Helper()
	f := &fakeAdmin{}
	conn := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		adminv1.RegisterAdminServiceServer(gs, f)
	})
	return f, []string{"--addr", conn.Target(), "--data-dir", t.TempDir()}
}

func TestDecoderCommandsUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"leases"}, ExitUsage, "curfew leases: give a subcommand: ls or cancel"},
		{[]string{"leases", "help"}, ExitOK, "curfew leases cancel --older-than D"},
		{[]string{"leases", "rm"}, ExitUsage, `unknown subcommand "rm"`},
		{[]string{"leases", "cancel"}, ExitUsage, "--older-than is required"},
		{[]string{"leases", "ls", "--older-than", "soon"}, ExitUsage, "give a positive duration"},
		{[]string{"leases", "ls", "x"}, ExitUsage, "takes no arguments"},
		{[]string{"ledger"}, ExitUsage, "give a subcommand: freeze or thaw or ls"},
		{[]string{"ledger", "freeze"}, ExitUsage, "give --run ID"},
		{[]string{"ledger", "thaw", "--reason", "x"}, ExitUsage, "give --run ID"},
		{[]string{"ledger", "help"}, ExitOK, "curfew ledger freeze (--run ID [--tenant T] | --tenant T)"},
		{[]string{"decoders"}, ExitUsage, "give a subcommand: drain or undrain"},
		{[]string{"decoders", "drain", "--cancel-after", "-1s"}, ExitUsage, "--cancel-after"},
		{[]string{"decoders", "undrain", "--cancel-after", "1s"}, ExitUsage, "flag provided but not defined"},
		{[]string{"help"}, ExitOK, "curfew decoders drain [--pool P]"},
	} {
		code, out, errs := curfew(tc.args...)
		if code != tc.code {
			t.Errorf("%q: exit %d, want %d (stderr %q)", tc.args, code, tc.code, errs)
		}
		if !strings.Contains(out+errs, tc.out) {
			t.Errorf("%q: output %q lacks %q", tc.args, out+errs, tc.out)
		}
	}
}

func TestLeasesCommands(t *testing.T) {
	f, addr := serveAdmin(t)
	code, out, errs := curfew(append([]string{"leases", "ls", "--older-than", "1m"}, addr...)...)
	if code != ExitOK {
		t.Fatalf("leases ls: exit %d: %s", code, errs)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	if len(lines) != 2 || strings.Join(strings.Fields(lines[0]), " ") != "REPLICA TENANT RUN NODE MODEL PROVIDER AGE HEARTBEAT TOKENS" {
		t.Fatalf("leases ls:\n%s", out)
	}
	if got := strings.Fields(lines[1]); got[0] != "mp-a" || got[2] != "run-1" || got[6] != "1m30s" || got[len(got)-1] != "42" {
		t.Errorf("lease row %q", lines[1])
	}
	if !strings.Contains(errs, "unreachable: modelproxy 10.0.0.2:7706") {
		t.Errorf("the unreachable replica is not named: %q", errs)
	}
	if r := f.last().(*adminv1.ListLeasesRequest); r.GetOlderThan().AsDuration() != time.Minute {
		t.Errorf("ListLeases request %v", r)
	}
	code, out, _ = curfew(append([]string{"leases", "ls", "--json"}, addr...)...)
	var v struct {
		Leases []map[string]any `json:"leases"`
	}
	if code != ExitOK || json.Unmarshal([]byte(out), &v) != nil || len(v.Leases) != 1 || v.Leases[0]["run_id"] != "run-1" {
		t.Fatalf("leases ls --json: exit %d %s", code, out)
	}
	code, out, errs = curfew(append([]string{"leases", "cancel", "--older-than", "30s", "--reason", "grace"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "cancelled 1 decoders (cause operator)") {
		t.Fatalf("leases cancel: exit %d: %s %s", code, out, errs)
	}
	if r := f.last().(*adminv1.CancelLeasesRequest); r.GetOlderThan().AsDuration() != 30*time.Second || r.GetReason() != "grace" {
		t.Errorf("CancelLeases request %v", r)
	}
}

func TestLedgerAndDecodersCommands(t *testing.T) {
	f, addr := serveAdmin(t)
	code, out, errs := curfew(append([]string{"ledger", "freeze", "--run", "run-1", "--reason", "leak"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "frozen: run run-1 of tenant acme") || !strings.Contains(out, "tokens after the freeze: 3") {
		t.Fatalf("ledger freeze: exit %d: %s %s", code, out, errs)
	}
	if r := f.last().(*adminv1.FreezeLedgerRequest); r.GetRunId() != "run-1" || r.GetTenant() != "" || r.GetReason() != "leak" {
		t.Errorf("FreezeLedger request %v", r)
	}
	code, _, errs = curfew(append([]string{"ledger", "freeze", "--run", "ambiguous"}, addr...)...)
	if code != ExitFail || !strings.Contains(errs, "InvalidArgument") {
		t.Errorf("an ambiguous run: exit %d: %s", code, errs)
	}
	code, out, _ = curfew(append([]string{"ledger", "thaw", "--tenant", "acme"}, addr...)...)
	if code != ExitOK || strings.TrimSpace(out) != "thawed" {
		t.Errorf("ledger thaw: exit %d: %s", code, out)
	}
	if r := f.last().(*adminv1.ThawLedgerRequest); r.GetTenant() != "acme" || r.GetRunId() != "" {
		t.Errorf("ThawLedger request %v", r)
	}
	code, out, _ = curfew(append([]string{"ledger", "ls"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "TOKENS_AFTER") || !strings.Contains(out, "mesh:curfew-cli") || !strings.Contains(out, "leak") {
		t.Errorf("ledger ls: exit %d:\n%s", code, out)
	}

	code, out, _ = curfew(append([]string{"decoders", "drain", "--pool", "overflow", "--cancel-after", "30s", "--reason", "rollback"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "drained: no new decoder for pool overflow") || !strings.Contains(out, "running ones cancelled at") {
		t.Errorf("decoders drain: exit %d: %s", code, out)
	}
	if r := f.last().(*adminv1.DrainDecodersRequest); r.GetPool() != "overflow" || r.GetCancelAfter().AsDuration() != 30*time.Second || r.GetReason() != "rollback" {
		t.Errorf("DrainDecoders request %v", r)
	}
	code, out, _ = curfew(append([]string{"decoders", "drain", "--json"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, `"drain"`) {
		t.Errorf("decoders drain --json: exit %d: %s", code, out)
	}
	if r := f.last().(*adminv1.DrainDecodersRequest); r.GetPool() != "" || r.GetCancelAfter() != nil {
		t.Errorf("a drain of every run: %v", r)
	}
	code, out, _ = curfew(append([]string{"decoders", "undrain", "--pool", "overflow"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "undrained: decoders start again for pool overflow") {
		t.Errorf("decoders undrain: exit %d: %s", code, out)
	}
	code, out, _ = curfew(append([]string{"decoders", "undrain"}, addr...)...)
	if code != ExitOK || !strings.Contains(out, "was not drained: every run") {
		t.Errorf("decoders undrain of nothing: exit %d: %s", code, out)
	}
}
