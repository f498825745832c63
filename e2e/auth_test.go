package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite" // the shared mesh's store
)

// tenantKey makes an API key for tenant with `curfew tenant create` (rotate-key when
// rotate) on the shared mesh's store, and returns the key.
func tenantKey(ctx context.Context, t *testing.T, tenant string, rotate bool) string {
	t.Helper()
	return tenantKeyOf(ctx, t, mesh, tenant, rotate)
}

// tenantKeyOf is tenantKey on mesh m.
func tenantKeyOf(ctx context.Context, t *testing.T, m *meshproc.Mesh, tenant string, rotate bool) string {
	t.Helper()
	sub := "create"
	if rotate {
		sub = "rotate-key"
	}
	out, err := exec.CommandContext(ctx, filepath.Join(m.Bin, "curfew"), "tenant", sub, tenant, "--data-dir", m.Dir, "--json").Output()
	if err != nil {
		t.Fatalf("curfew tenant %s %s: %v", sub, tenant, err)
	}
	var k struct {
		Key    string `json:"key"`
		Tenant string `json:"tenant"`
	}
	if err := json.Unmarshal(out, &k); err != nil || k.Key == "" || k.Tenant != tenant {
		t.Fatalf("curfew tenant %s %s printed %s (%v)", sub, tenant, out, err)
	}
	return k.Key
}

// external is a client of the orchestrator from outside the mesh: TLS that trusts the
// mesh CA but presents no certificate, and sends key ("" for none) as a bearer token.
type external struct {
	orch orchestratorv1.OrchestratorServiceClient
	dlq  orchestratorv1.DeadLetterServiceClient
}

func newExternal(t *testing.T, key string) external {
	t.Helper()
	var opts []grpc.DialOption
	if key != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(apikey.Bearer(key)))
	}
	cc, err := mesh.ConnWith("orchestrator", tlsCreds(t, requireTLS(t), nil), opts...)
	if err != nil {
		t.Fatal(err)
	}
	return external{orch: orchestratorv1.NewOrchestratorServiceClient(cc), dlq: orchestratorv1.NewDeadLetterServiceClient(cc)}
}

// twoTenants makes two tenants of the shared mesh, named after a fresh tag, each with a
// key, and an external client for each.
func twoTenants(ctx context.Context, t *testing.T) (tag, ta, tb string, a, b external) {
	t.Helper()
	tag = uuid.NewString()[:8]
	ta, tb = "a-"+tag, "b-"+tag
	return tag, ta, tb, newExternal(t, tenantKey(ctx, t, ta, false)), newExternal(t, tenantKey(ctx, t, tb, false))
}

// forged returns ctx with a curfew-tenant header naming tenant.
func forged(ctx context.Context, tenant string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, md.Tenant, tenant)
}

// Authentication: an external caller needs a valid, unrevoked API key.
func TestAuthAPIKeys(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tenant := "auth-" + uuid.NewString()[:8]
	key := tenantKey(ctx, t, tenant, false)

	for _, c := range []struct {
		name string
		key  string
	}{
		{"no key", ""},
		{"wrong secret", key[:len(key)-4] + "AAAA"},
		{"not a key", "hunter2"},
	} {
		_, err := newExternal(t, c.key).orch.ListRuns(forged(ctx, tenant), &orchestratorv1.ListRunsRequest{})
		if status.Code(err) != codes.Unauthenticated {
			t.Errorf("%s: ListRuns = %v, want UNAUTHENTICATED", c.name, err)
		}
	}
	ok := newExternal(t, key)
	res, _ := runPlan(ctx, ok.orch, `{"tokens_per_second": 500, "steps": [{"answer_tokens": 2}]}`, 10*time.Second, 0, false)
	if res.err != nil || res.finished.GetTenant() != tenant {
		t.Fatalf("a run with the key: %v, tenant %q; want success for %s", res.err, res.finished.GetTenant(), tenant)
	}

	// After rotation the old key is refused at once, and the new one works.
	newKey := tenantKey(ctx, t, tenant, true)
	if _, err := ok.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("the rotated-out key: ListRuns = %v, want UNAUTHENTICATED", err)
	}
	got, err := newExternal(t, newKey).orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: res.started.GetRunId()})
	if err != nil || got.GetRun().GetTenant() != tenant {
		t.Errorf("the new key: GetRun = %v, %v", got.GetRun(), err)
	}
}

// Tenant isolation: tenant A cannot get, watch, list or cancel tenant B's run, nor see
// or replay B's dead letters, with or without a forged curfew-tenant: B header; reusing
// B's retry-id or idempotency key joins nothing of B's.
func TestAuthTenantIsolation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tag, ta, tb, a, b := twoTenants(ctx, t)

	// B's long run, a Run stream under a retry-id, and a run of B's under an
	// idempotency key.
	const slow = `{"tokens_per_second": 20, "steps": [{"answer_tokens": 2000}]}`
	const quick = `{"tokens_per_second": 500, "steps": [{"answer_tokens": 1}]}`
	rid := "rid-" + tag
	bctx, bcancel := context.WithTimeout(metadata.AppendToOutgoingContext(ctx, md.RetryID, rid, md.Attempt, "1"), 90*time.Second)
	defer bcancel()
	bStream, err := b.orch.Run(bctx, &orchestratorv1.RunRequest{Task: slow})
	if err != nil {
		t.Fatal(err)
	}
	first, err := bStream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	bRun := first.GetStarted().GetRunId()
	bEnded := make(chan error, 1)
	go func() {
		for {
			if _, err := bStream.Recv(); err != nil {
				bEnded <- err
				return
			}
		}
	}()
	bKeyed, err := b.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: quick, IdempotencyKey: "key-" + tag, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}

	for _, actx := range []context.Context{ctx, forged(ctx, tb)} {
		for _, id := range []string{bRun, bKeyed.GetRun().GetRunId()} {
			_, err := a.orch.GetRun(actx, &orchestratorv1.GetRunRequest{RunId: id})
			wantNotFound(t, "A's GetRun of B's run", err)
			_, err = a.orch.CancelRun(actx, &orchestratorv1.CancelRunRequest{RunId: id})
			wantNotFound(t, "A's CancelRun of B's run", err)
			w, err := a.orch.WatchRun(actx, &orchestratorv1.WatchRunRequest{RunId: id})
			if err == nil {
				_, err = w.Recv()
			}
			wantNotFound(t, "A's WatchRun of B's run", err)
		}
		list, err := a.orch.ListRuns(actx, &orchestratorv1.ListRunsRequest{PageSize: 500})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range list.GetRuns() {
			if r.GetTenant() != ta {
				t.Errorf("A's ListRuns holds run %s of tenant %q", r.GetRunId(), r.GetTenant())
			}
		}
	}

	// A reuses B's idempotency key: a new run of its own, not B's.
	aStart, err := a.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: quick, IdempotencyKey: "key-" + tag, Timeout: durationpb.New(30 * time.Second)})
	if err != nil || !aStart.GetCreated() || aStart.GetRun().GetRunId() == bKeyed.GetRun().GetRunId() || aStart.GetRun().GetTenant() != ta {
		t.Fatalf("A's StartRun with B's idempotency key = %v, %v; want a new run of A's", aStart, err)
	}
	// A reuses B's retry-id with a later attempt: were the in-flight table not keyed by
	// tenant, it would supersede (cancel) B's Run call and wait for its teardown.
	res, _ := runPlan(metadata.AppendToOutgoingContext(ctx, md.RetryID, rid, md.Attempt, "2"), a.orch, quick, 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetTenant() != ta {
		t.Fatalf("A's Run under B's retry-id: %v (tenant %q)", res.err, res.finished.GetTenant())
	}

	// B's run went on through all of it; B still holds its keyed run.
	select {
	case err := <-bEnded:
		t.Fatalf("B's Run stream ended while A called: %v", err)
	default:
	}
	got, err := b.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: bRun})
	if err != nil || got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		t.Fatalf("B's run after A's calls: %v, %v; want still running", got.GetRun(), err)
	}
	again, err := b.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: quick, IdempotencyKey: "key-" + tag, Timeout: durationpb.New(30 * time.Second)})
	if err != nil || again.GetCreated() || again.GetRun().GetRunId() != bKeyed.GetRun().GetRunId() {
		t.Fatalf("B's StartRun with its key again = %v, %v; want its own run %s", again, err, bKeyed.GetRun().GetRunId())
	}
	// B, and only B, cancels its run.
	if _, err := b.orch.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: bRun}); err != nil {
		t.Fatal(err)
	}
	if err := <-bEnded; status.Code(err) != codes.Canceled {
		t.Fatalf("B's Run stream ended with %v, want CANCELED by B's cancel", err)
	}
}

// Isolation of tool side effects: a kv_put of tenant B with the idempotency key
// of A's takes effect for B, instead of replaying A's result; each tenant's entry holds its
// own value, written once.
func TestAuthToolIdempotencyKeyIsPerTenant(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tag, ta, tb, a, b := twoTenants(ctx, t)
	put := func(c external, value string) {
		t.Helper()
		plan := `{"tokens_per_second": 500, "steps": [
		  {"think_tokens": 1, "tools": [{"name": "kv_put", "idempotency_key": "same-` + tag + `",
		    "args": {"key": "k-` + tag + `", "value": "` + value + `"}}]},
		  {"answer_tokens": 1}]}`
		if res, _ := runPlan(ctx, c.orch, plan, 30*time.Second, 0, false); res.err != nil {
			t.Fatalf("kv_put %s: %v", value, res.err)
		}
	}
	put(a, "A")
	put(b, "B")
	st, err := store.Open(ctx, "sqlite://"+filepath.Join(mesh.Dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	for tenant, want := range map[string]string{ta: `"A"`, tb: `"B"`} {
		kv, err := st.GetKV(ctx, tenant, "k-"+tag)
		if err != nil || string(kv.Value) != want || kv.Version != 1 {
			t.Errorf("%s's entry = %q (version %d), %v; want %s written once by its own call", tenant, kv.Value, kv.Version, err, want)
		}
	}
}

// Isolation of dead letters: B's are invisible to A, and A cannot replay them.
func TestAuthDeadLetterIsolation(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tag, _, tb, a, b := twoTenants(ctx, t)
	plan := `{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 2, "tools": [{"name": "fail", "args": {"code": "INVALID_ARGUMENT", "times": 5}}]},
	  {"answer_tokens": 1}]}`
	start, err := b.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, IdempotencyKey: "dl-" + tag, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	run := start.GetRun().GetRunId()
	var id string
	for deadline := time.Now().Add(30 * time.Second); id == ""; {
		list, err := b.dlq.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{RunId: run})
		if err != nil {
			t.Fatal(err)
		}
		if len(list.GetDeadLetters()) > 0 {
			id = list.GetDeadLetters()[0].GetId()
			if got := list.GetDeadLetters()[0].GetTenant(); got != tb {
				t.Fatalf("B's dead letter has tenant %q", got)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no dead letter for B's run %s within 30s", run)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, actx := range []context.Context{ctx, forged(ctx, tb)} {
		list, err := a.dlq.ListDeadLetters(actx, &orchestratorv1.ListDeadLettersRequest{RunId: run, IncludeReplayed: true})
		if err != nil || len(list.GetDeadLetters()) != 0 {
			t.Errorf("A's ListDeadLetters of B's run = %v, %v; want none", list.GetDeadLetters(), err)
		}
		_, err = a.dlq.GetDeadLetter(actx, &orchestratorv1.GetDeadLetterRequest{Id: id})
		wantNotFound(t, "A's GetDeadLetter of B's", err)
		_, err = a.dlq.ReplayDeadLetter(actx, &orchestratorv1.ReplayDeadLetterRequest{Id: id})
		wantNotFound(t, "A's ReplayDeadLetter of B's", err)
		if p, err := a.dlq.PurgeDeadLetters(actx, &orchestratorv1.PurgeDeadLettersRequest{Id: id}); status.Code(err) != codes.NotFound && (err != nil || p.GetPurged() != 0) {
			t.Errorf("A's PurgeDeadLetters of B's = %v, %v; want none purged", p, err)
		}
	}
	if got, err := b.dlq.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: id}); err != nil || got.GetDeadLetter().GetReplayedAt() != nil {
		t.Errorf("B's dead letter after A's attempts: %v, %v; want it there, not replayed", got, err)
	}
}

func wantNotFound(t *testing.T, what string, err error) {
	t.Helper()
	if status.Code(err) != codes.NotFound {
		t.Errorf("%s: %v, want NOT_FOUND", what, err)
	}
}

// Request limits, on an authenticated external caller over TLS: an oversized request,
// oversized metadata, a plan over its byte or tool-call bound are each refused with a
// clear status and nothing started, and the orchestrator goes on serving.
func TestAuthRequestLimits(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tenant := "limits-" + uuid.NewString()[:8]
	c := newExternal(t, tenantKey(ctx, t, tenant, false))
	call := func(ctx context.Context, task string) error {
		st, err := c.orch.Run(ctx, &orchestratorv1.RunRequest{Task: task})
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}
	sleeps := strings.TrimSuffix(strings.Repeat(`{"name":"sleep","args":{"ms":1}},`, 16), ",")
	sub := `{"steps":[` + strings.TrimSuffix(strings.Repeat(`{"tools":[`+sleeps+`]},`, 5), ",") + `,{"answer_tokens":1}]}`
	spawns := strings.TrimSuffix(strings.Repeat(`{"name":"spawn_subagent","args":{"plan":`+sub+`}},`, 16), ",")
	for _, tc := range []struct {
		name string
		ctx  context.Context
		task string
		code codes.Code
		msg  string
	}{
		{"a 5 MiB request", ctx, `{"steps":[{"answer_tokens":1}],"prompt":"` + strings.Repeat("x", 5<<20) + `"}`, codes.ResourceExhausted, "larger than max"},
		{"a 300 KiB plan", ctx, `{"steps":[{"answer_tokens":1}],"prompt":"` + strings.Repeat("x", 300<<10) + `"}`, codes.InvalidArgument, "at most 262144 bytes"},
		{"a plan of 1296 tool calls", ctx, `{"steps":[{"tools":[` + spawns + `]},{"answer_tokens":1}]}`, codes.InvalidArgument, "more than 1024 tools in all"},
		{"128 KiB of metadata", metadata.AppendToOutgoingContext(ctx, "x-padding", strings.Repeat("y", 128<<10)), `{"steps":[{"answer_tokens":1}]}`, codes.Internal, "header list size"},
	} {
		err := call(tc.ctx, tc.task)
		if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.msg) {
			t.Errorf("%s: %v, want %v with %q", tc.name, err, tc.code, tc.msg)
		}
	}
	list, err := c.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(list.GetRuns()) != 0 {
		t.Fatalf("runs of %s after the refusals: %v, %v; want none started", tenant, list.GetRuns(), err)
	}
	res, _ := runPlan(ctx, c.orch, `{"tokens_per_second": 500, "steps": [{"answer_tokens": 2}]}`, 10*time.Second, 0, false)
	if res.err != nil {
		t.Fatalf("a run after the refusals: %v", res.err)
	}
}

// The per-tenant request rate: every call of the public API spends a token of its
// authenticated tenant's bucket; a call over it is RESOURCE_EXHAUSTED with the shed reason
// and a RetryInfo delay, other tenants go on, and after the delay the tenant may call
// again. On a mesh of its own, with an admission file that limits one tenant.
func TestAuthTenantRequestRate(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	adm := filepath.Join(dir, "admission.json")
	// One token per 5 s after a burst of 3: the burst is spent long before a token comes.
	if err := os.WriteFile(adm, []byte(`{"pools": [{"name": "paid", "max_in_flight": 64}],
	  "tenants": {"slow": {"request_rate": 0.2, "request_burst": 3}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := meshproc.Start(ctx, filepath.Join(dir, "data"), meshproc.Options{Env: []string{"CURFEW_ADMISSION_CONFIG=" + adm}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
	}()
	cc, err := m.ConnWith("orchestrator", tlsCreds(t, m.Endpoints.TLSDir, nil), grpc.WithPerRPCCredentials(apikey.Bearer(tenantKeyOf(ctx, t, m, "slow", false))))
	if err != nil {
		t.Fatal(err)
	}
	slow := orchestratorv1.NewOrchestratorServiceClient(cc)
	other, err := m.Orchestrator() // curfew-cli, tenant default: no request limit
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := slow.ListRuns(ctx, &orchestratorv1.ListRunsRequest{}); err != nil {
			t.Fatalf("call %d of the burst: %v", i+1, err)
		}
	}
	_, err = slow.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: "any"})
	st := status.Convert(err)
	var delay time.Duration
	var reasons []string
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.RetryInfo:
			delay = d.GetRetryDelay().AsDuration()
		case *errdetails.ErrorInfo:
			reasons = append(reasons, d.GetReason())
		}
	}
	if st.Code() != codes.ResourceExhausted || !slices.Contains(reasons, "SHED_REQUEST_RATE_LIMITED") || delay <= 0 || delay > 5*time.Second {
		t.Fatalf("the call after the burst: %v (reasons %q, retry in %v), want RESOURCE_EXHAUSTED, SHED_REQUEST_RATE_LIMITED, a delay ≤ 5s", err, reasons, delay)
	}
	if _, err := other.ListRuns(ctx, &orchestratorv1.ListRunsRequest{}); err != nil {
		t.Fatalf("another tenant while slow is limited: %v", err)
	}
	time.Sleep(delay + 100*time.Millisecond)
	if _, err := slow.ListRuns(ctx, &orchestratorv1.ListRunsRequest{}); err != nil {
		t.Fatalf("after the RetryInfo delay: %v", err)
	}
	body, err := httpGet("http://" + m.Endpoints.Services["orchestrator"].AdminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(body, `curfew_shed_total{reason="request_rate_limited",service="orchestrator"} 1`) {
		t.Errorf("/metrics does not count the refusal once:\n%s", grepLines(body, "curfew_shed_total"))
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
