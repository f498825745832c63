package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

func (f *fakeAdmin) ClosePool(_ context.Context, req *adminv1.ClosePoolRequest) (*adminv1.ClosePoolResponse, error) {
	f.got(req)
	return &adminv1.ClosePoolResponse{Pool: &adminv1.PoolState{Pool: req.GetPool(), Replica: "orch-a", OperatorClosed: true,
		OperatorActor: "key:k1", OperatorReason: req.GetReason()}}, nil
}

func (f *fakeAdmin) OpenPool(_ context.Context, req *adminv1.OpenPoolRequest) (*adminv1.OpenPoolResponse, error) {
	f.got(req)
	return &adminv1.OpenPoolResponse{Pool: &adminv1.PoolState{Pool: req.GetPool(), Replica: "orch-a"}}, nil
}

// ReopenPool waits two reports, then opens.
func (f *fakeAdmin) ReopenPool(req *adminv1.ReopenPoolRequest, stream adminv1.AdminService_ReopenPoolServer) error {
	f.got(req)
	for _, rep := range []*adminv1.ReopenPoolResponse{
		{OrphanDelta: 5, QuietFor: durationpb.New(0)},
		{QuietFor: durationpb.New(time.Second)},
		{QuietFor: durationpb.New(2 * time.Second), Opened: true, Pool: &adminv1.PoolState{Pool: req.GetPool(), Replica: "orch-a"}},
	} {
		if err := stream.Send(rep); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeAdmin) Status(_ context.Context, req *adminv1.StatusRequest) (*adminv1.StatusResponse, error) {
	f.got(req)
	return &adminv1.StatusResponse{Replica: "orch-a", OrphanDelta: 7, OrphanWindow: durationpb.New(time.Minute), DeadLetterDepth: 2,
		Pools: []*adminv1.PoolState{{Pool: "overflow", OperatorClosed: true, OperatorActor: "key:k1", OperatorReason: "drill",
			AutoConditions: []string{"orphan_tokens"}, AutoClosedUntil: timestamppb.Now(), InFlight: 1, MaxInFlight: 4}},
		Breakers:    []*adminv1.BreakerState{{Service: "modelproxy", Replica: "mp-a", Target: "openai", State: "open"}},
		Leases:      []*adminv1.Lease{testLease()},
		Configs:     []*adminv1.ReplicaConfig{{Service: "orchestrator", Replica: "orch-b", Config: "admission", Version: "v2", SeenAt: timestamppb.Now(), LoadedAt: timestamppb.Now()}},
		Unreachable: []string{"modelproxy mp-b: timeout"},
		Coordination: []*adminv1.Coordination{
			{Service: "orchestrator", Replica: "orch-a", Part: "retry_window", Target: "modelproxy", Held: true,
				Until: timestamppb.New(time.Now().Add(5 * time.Second)), Detail: "window 0 (epoch 4) held for 5s of 1 window(s) of 10s across replicas"},
			{Service: "orchestrator", Replica: "orch-a", Part: "retry_window", Target: "toolrunner", Degraded: true, Refused: 3,
				Since: timestamppb.New(statusSince), Detail: "store unreachable: retries that need a window are refused; 3 retries refused"},
			{Service: "modelproxy", Replica: "mp-a", Part: "budget", Degraded: true, Since: timestamppb.New(statusSince),
				Detail: "store unreachable: reserving against this replica's share, (budget - used) / 2 replicas"},
			{Service: "modelproxy", Replica: "mp-a", Part: "breaker_probe", Target: "openai", Until: timestamppb.New(time.Now().Add(time.Minute)),
				Detail: "another replica holds the probe lease for 1m0s"},
			{Service: "modelproxy", Replica: "mp-a", Part: "breaker_probe", Target: "anthropic", Detail: "one probe per open period across replicas"},
		},
	}, nil
}

// statusSince is when the fake's degraded coordination began.
var statusSince = time.Date(2026, 12, 4, 19, 0, 0, 0, time.UTC)

func TestPoolCommandsUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"pool"}, ExitUsage, "curfew pool: give a subcommand: close or open or reopen"},
		{[]string{"pool", "help"}, ExitOK, "curfew pool reopen POOL --when-orphan-delta-zero FOR"},
		{[]string{"pool", "shut", "overflow"}, ExitUsage, `unknown subcommand "shut"`},
		{[]string{"pool", "close"}, ExitUsage, "give one POOL"},
		{[]string{"pool", "reopen", "overflow"}, ExitUsage, "--when-orphan-delta-zero is required"},
		{[]string{"pool", "close", "overflow", "--force"}, ExitUsage, "flag provided but not defined"},
		{[]string{"status", "x"}, ExitUsage, "takes no arguments"},
		{[]string{"approvals"}, ExitUsage, "curfew approvals: give a subcommand: ls"},
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

func TestPoolCommands(t *testing.T) {
	f, addr := serveAdmin(t)
	code, out, errs := curfew(append([]string{"pool", "close", "overflow", "--reason", "drill"}, addr...)...)
	if code != ExitOK || strings.TrimSpace(out) != "pool overflow closed on orch-a: closed by key:k1: drill" {
		t.Fatalf("pool close: exit %d: %q %s", code, out, errs)
	}
	if r := f.last().(*adminv1.ClosePoolRequest); r.GetPool() != "overflow" || r.GetReason() != "drill" {
		t.Errorf("ClosePool request %v", r)
	}
	code, out, _ = curfew(append([]string{"pool", "open", "overflow", "--force"}, addr...)...)
	if code != ExitOK || strings.TrimSpace(out) != "pool overflow open on orch-a" {
		t.Errorf("pool open: exit %d: %q", code, out)
	}
	if r := f.last().(*adminv1.OpenPoolRequest); !r.GetForce() {
		t.Errorf("OpenPool request %v, want force", r)
	}
	code, out, _ = curfew(append([]string{"pool", "reopen", "overflow", "--when-orphan-delta-zero", "2s"}, addr...)...)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != ExitOK || len(lines) != 3 || lines[0] != "waiting: orphan delta 5, zero for 0s of 2s" ||
		!strings.HasPrefix(lines[2], "orphan delta zero for 2s: opened.") {
		t.Errorf("pool reopen: exit %d:\n%s", code, out)
	}
	if r := f.last().(*adminv1.ReopenPoolRequest); r.GetWindow().AsDuration() != 2*time.Second {
		t.Errorf("ReopenPool request %v", r)
	}
}

func TestStatusCommand(t *testing.T) {
	_, addr := serveAdmin(t)
	code, out, errs := curfew(append([]string{"status"}, addr...)...)
	if code != ExitOK {
		t.Fatalf("status: exit %d: %s", code, errs)
	}
	for _, want := range []string{
		"replica orch-a", "orphan delta 7 tokens in the last 1m0s; dead letters 2", "not reached: modelproxy mp-b: timeout",
		"overflow  closed", "operator key:k1: drill", "auto orphan_tokens", "1/4",
		"modelproxy  mp-a", "openai  open", "run-1", "admission  v2",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	// COORDINATION: one line per limit and replica; a degraded one reads DEGRADED with
	// its detail and since when.
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		lines = append(lines, strings.Join(strings.Fields(l), " "))
	}
	joined := strings.Join(lines, "\n")
	for _, want := range []string{
		"COORDINATION\nSERVICE REPLICA PART TARGET STATE DETAIL\n" +
			"orchestrator orch-a retry_window modelproxy held window 0 (epoch 4) held for 5s of 1 window(s) of 10s across replicas\n" +
			"orchestrator orch-a retry_window toolrunner DEGRADED store unreachable: retries that need a window are refused; 3 retries refused (since 2026-12-04T19:00:00Z)\n" +
			"modelproxy mp-a budget - DEGRADED store unreachable: reserving against this replica's share, (budget - used) / 2 replicas (since 2026-12-04T19:00:00Z)\n" +
			"modelproxy mp-a breaker_probe openai elsewhere another replica holds the probe lease for 1m0s\n" +
			"modelproxy mp-a breaker_probe anthropic coordinated one probe per open period across replicas\n\nDECODERS",
	} {
		if !strings.Contains(joined, want) {
			t.Errorf("status lacks\n%s\nin\n%s", want, out)
		}
	}
	code, out, errs = curfew(append([]string{"status", "--json"}, addr...)...)
	if code != ExitOK {
		t.Fatalf("status --json: exit %d: %s", code, errs)
	}
	var js struct {
		Coordination []struct {
			Service, Replica, Part, Target, Detail string
			Degraded                               bool
			Since                                  string
		}
	}
	if err := json.Unmarshal([]byte(out), &js); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if c := js.Coordination; len(c) != 5 || c[2].Part != "budget" || !c[2].Degraded || c[2].Since != "2026-12-04T19:00:00Z" ||
		!strings.Contains(c[2].Detail, "this replica's share") || c[1].Target != "toolrunner" || !c[1].Degraded {
		t.Errorf("status --json coordination %+v, want the five, the budget degraded since 19:00", c)
	}
}
