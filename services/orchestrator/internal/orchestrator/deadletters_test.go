package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

// replays is a Replayer double that dedupes by key like the real one (StartRun's
// idempotency key): the first call with a key "starts" a run, later calls return it.
type replays struct {
	mu       sync.Mutex
	runs     map[string]string // key → run id
	calls    int
	started  int
	keys     []string
	payloads [][]byte
	timeouts []time.Duration
	fail     error // returned once, before anything is started
}

func (r *replays) replay(_ context.Context, key string, payload []byte, timeout time.Duration) (string, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	r.keys = append(r.keys, key)
	r.payloads = append(r.payloads, payload)
	r.timeouts = append(r.timeouts, timeout)
	if err := r.fail; err != nil {
		r.fail = nil
		return "", false, err
	}
	if id, ok := r.runs[key]; ok {
		return id, false, nil
	}
	if r.runs == nil {
		r.runs = map[string]string{}
	}
	id := uuid.Must(uuid.NewV7()).String()
	r.runs[key] = id
	r.started++
	return id, true, nil
}

func (r *replays) failOnce(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = err
}

func (r *replays) counts() (calls, started int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls, r.started
}

type dlEnv struct {
	st      store.Store
	client  orchestratorv1.DeadLetterServiceClient
	replays *replays
}

// newDLEnv serves a DeadLetterServer on a real SQLite store in t.TempDir() behind the
// mesh's server chain, which sets the caller's identity from its metadata.
func newDLEnv(t *testing.T) *dlEnv {
	t.Helper()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() }) // runs after the server has stopped
	r := &replays{}
	srv := NewDeadLetterServer(st, r.replay)
	conn := meshtest.Serve(t, mesh.ServerConfig{Logger: quiet}, func(gs *grpc.Server) {
		orchestratorv1.RegisterDeadLetterServiceServer(gs, srv)
	})
	return &dlEnv{st: st, client: orchestratorv1.NewDeadLetterServiceClient(conn), replays: r}
}

// as is a context whose calls carry tenant in the curfew-tenant header.
func as(tenant string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), md.Tenant, tenant)
}

// add stores a dead letter of tenant for run and step.
func (e *dlEnv) add(t *testing.T, tenant, run, step string) store.DeadLetter {
	t.Helper()
	d, added, err := e.st.AddDeadLetter(context.Background(), store.DeadLetter{
		Tenant: tenant, RunID: run, Step: step, ErrorType: "unavailable", Attempts: 3,
		LastError: "modelproxy: connection refused", Payload: []byte(`{"task":"t-` + run + `","model":"sim"}`),
		IdempotencyKey: "key-" + run,
	})
	if err != nil || !added {
		t.Fatalf("AddDeadLetter: added=%v err=%v", added, err)
	}
	return d
}

func (e *dlEnv) depth(t *testing.T, tenant string) int64 {
	t.Helper()
	n, err := e.st.DeadLetterDepth(context.Background(), tenant)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func ids(dls []*orchestratorv1.DeadLetter) []string {
	out := make([]string, len(dls))
	for i, d := range dls {
		out[i] = d.GetId()
	}
	return out
}

func TestDeadLetterListPaging(t *testing.T) {
	e := newDLEnv(t)
	ctx := context.Background() // the default tenant
	var all []store.DeadLetter
	for i := range 5 {
		all = append(all, e.add(t, md.DefaultTenant, fmt.Sprintf("run-%d", i), RootNode))
	}
	// One replayed: hidden unless include_replayed.
	if _, err := e.st.MarkReplayed(ctx, md.DefaultTenant, all[2].ID); err != nil {
		t.Fatal(err)
	}
	list := func(req *orchestratorv1.ListDeadLettersRequest) []string {
		t.Helper()
		var got []string
		for pages := 0; ; pages++ {
			if pages > 10 {
				t.Fatal("paging does not end")
			}
			resp, err := e.client.ListDeadLetters(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if n := len(resp.GetDeadLetters()); req.GetPageSize() > 0 && n > int(req.GetPageSize()) {
				t.Fatalf("page of %d, page_size %d", n, req.GetPageSize())
			}
			got = append(got, ids(resp.GetDeadLetters())...)
			if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
				return got
			}
		}
	}
	want := func(idx ...int) string {
		var s []string
		for _, i := range idx {
			s = append(s, all[i].ID)
		}
		return strings.Join(s, ",")
	}
	if got := strings.Join(list(&orchestratorv1.ListDeadLettersRequest{PageSize: 2}), ","); got != want(4, 3, 1, 0) {
		t.Errorf("open ones, newest first, by 2:\n got %s\nwant %s", got, want(4, 3, 1, 0))
	}
	if got := strings.Join(list(&orchestratorv1.ListDeadLettersRequest{PageSize: 2, IncludeReplayed: true}), ","); got != want(4, 3, 2, 1, 0) {
		t.Errorf("include_replayed:\n got %s\nwant %s", got, want(4, 3, 2, 1, 0))
	}
	if got := strings.Join(list(&orchestratorv1.ListDeadLettersRequest{}), ","); got != want(4, 3, 1, 0) {
		t.Errorf("default page size: %s", got)
	}
	if got := strings.Join(list(&orchestratorv1.ListDeadLettersRequest{PageSize: 5000, IncludeReplayed: true}), ","); got != want(4, 3, 2, 1, 0) {
		t.Errorf("page_size above the maximum is capped, not refused: %s", got)
	}
	if got := strings.Join(list(&orchestratorv1.ListDeadLettersRequest{RunId: "run-3"}), ","); got != want(3) {
		t.Errorf("run_id filter: %s", got)
	}

	resp, err := e.client.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{PageSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	d := resp.GetDeadLetters()[0]
	if d.GetId() != all[4].ID || d.GetTenant() != md.DefaultTenant || d.GetRunId() != "run-4" || d.GetStep() != RootNode ||
		d.GetErrorType() != "unavailable" || d.GetAttempts() != 3 || d.GetLastError() != "modelproxy: connection refused" ||
		string(d.GetPayload()) != `{"task":"t-run-4","model":"sim"}` || d.GetIdempotencyKey() != "key-run-4" ||
		!d.GetCreatedAt().AsTime().Equal(all[4].CreatedAt) || d.GetReplayedAt() != nil || d.GetReplayCount() != 0 {
		t.Errorf("dead letter fields: %v", d)
	}
	if resp.GetNextPageToken() != all[4].ID {
		t.Errorf("next_page_token = %q, want the last id of the page", resp.GetNextPageToken())
	}

	_, err = e.client.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{PageSize: -1})
	meshtest.WantCode(t, err, codes.InvalidArgument, "page_size")
	_, err = e.client.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{PageToken: "' OR 1=1 --"})
	meshtest.WantCode(t, err, codes.InvalidArgument, "page_token is not one this service issued")
}

func TestDeadLetterTenantIsolation(t *testing.T) {
	e := newDLEnv(t)
	mine := e.add(t, "acme", "run-a", RootNode)
	theirs := e.add(t, md.DefaultTenant, "run-d", RootNode)
	other := e.add(t, "globex", "run-g", RootNode)

	for tenant, want := range map[string]string{"acme": mine.ID, md.DefaultTenant: theirs.ID, "globex": other.ID} {
		resp, err := e.client.ListDeadLetters(as(tenant), &orchestratorv1.ListDeadLettersRequest{IncludeReplayed: true})
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(ids(resp.GetDeadLetters()), ","); got != want {
			t.Errorf("tenant %s lists %s, want only its own %s", tenant, got, want)
		}
	}
	// Without the header the chain makes the caller the default tenant, not all tenants.
	resp, err := e.client.ListDeadLetters(context.Background(), &orchestratorv1.ListDeadLettersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(ids(resp.GetDeadLetters()), ","); got != theirs.ID {
		t.Errorf("no tenant header lists %s, want the default tenant's %s", got, theirs.ID)
	}

	acme := as("acme")
	_, err = e.client.GetDeadLetter(acme, &orchestratorv1.GetDeadLetterRequest{Id: theirs.ID})
	meshtest.WantCode(t, err, codes.NotFound)
	_, err = e.client.ReplayDeadLetter(acme, &orchestratorv1.ReplayDeadLetterRequest{Id: theirs.ID})
	meshtest.WantCode(t, err, codes.NotFound)
	if calls, _ := e.replays.counts(); calls != 0 {
		t.Errorf("another tenant's dead letter was replayed (%d calls)", calls)
	}
	if e.depth(t, md.DefaultTenant) != 1 {
		t.Error("another tenant's replay marked the dead letter")
	}
	p, err := e.client.PurgeDeadLetters(acme, &orchestratorv1.PurgeDeadLettersRequest{Id: theirs.ID})
	if err != nil || p.GetPurged() != 0 {
		t.Errorf("purge of another tenant's id: %v, %v", p, err)
	}
	p, err = e.client.PurgeDeadLetters(acme, &orchestratorv1.PurgeDeadLettersRequest{Before: timestamppb.New(time.Now().Add(time.Hour))})
	if err != nil || p.GetPurged() != 1 {
		t.Errorf("purge before an hour from now, as acme: %v, %v, want 1", p, err)
	}
	if e.depth(t, "") != 2 || e.depth(t, "acme") != 0 {
		t.Errorf("acme's purge reached other tenants: depth %d, acme %d", e.depth(t, ""), e.depth(t, "acme"))
	}

	// Called directly without any identity (no server chain), it still is one tenant.
	srv := NewDeadLetterServer(e.st, e.replays.replay)
	direct, err := srv.ListDeadLetters(context.Background(), &orchestratorv1.ListDeadLettersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(ids(direct.GetDeadLetters()), ","); got != theirs.ID {
		t.Errorf("no identity lists %s, want the default tenant's %s only", got, theirs.ID)
	}
	direct, err = srv.ListDeadLetters(md.WithIdentity(context.Background(), md.Identity{Tenant: "globex"}), &orchestratorv1.ListDeadLettersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(ids(direct.GetDeadLetters()), ","); got != other.ID {
		t.Errorf("identity globex lists %s, want %s", got, other.ID)
	}
}

func TestDeadLetterReplayTwiceStartsOneRun(t *testing.T) {
	e := newDLEnv(t)
	ctx := as("acme")
	d := e.add(t, "acme", "run-1", "root/s1.t0")
	e.add(t, "acme", "run-2", RootNode)
	if e.depth(t, "acme") != 2 {
		t.Fatal("depth before replay")
	}

	first, err := e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID, Timeout: durationpb.New(90 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if !first.GetCreated() || first.GetRunId() == "" {
		t.Fatalf("first replay: %v, want a new run", first)
	}
	got := first.GetDeadLetter()
	if got.GetId() != d.ID || got.GetReplayedAt() == nil || got.GetReplayCount() != 1 {
		t.Errorf("first replay returns the dead letter as marked: %v", got)
	}
	if e.depth(t, "acme") != 1 {
		t.Errorf("depth after replay = %d, want 1", e.depth(t, "acme"))
	}

	second, err := e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID})
	if err != nil {
		t.Fatal(err)
	}
	if second.GetCreated() || second.GetRunId() != first.GetRunId() {
		t.Errorf("second replay: created=%v run %s, want created=false and run %s", second.GetCreated(), second.GetRunId(), first.GetRunId())
	}
	if second.GetDeadLetter().GetReplayCount() != 1 || !second.GetDeadLetter().GetReplayedAt().AsTime().Equal(got.GetReplayedAt().AsTime()) {
		t.Errorf("second replay changed the mark: %v", second.GetDeadLetter())
	}
	if e.depth(t, "acme") != 1 {
		t.Errorf("depth after the second replay = %d, want 1", e.depth(t, "acme"))
	}

	calls, started := e.replays.counts()
	if calls != 2 || started != 1 {
		t.Errorf("replayer: %d calls, %d runs started; want 2 calls and 1 run", calls, started)
	}
	for i, k := range e.replays.keys {
		if k != "dlq-replay/"+d.ID || string(e.replays.payloads[i]) != string(d.Payload) {
			t.Errorf("call %d: key %q payload %q, want dlq-replay/%s and the dead letter's payload", i, k, e.replays.payloads[i], d.ID)
		}
	}
	if e.replays.timeouts[0] != 90*time.Second || e.replays.timeouts[1] != 0 {
		t.Errorf("timeouts passed: %v, want [1m30s 0s]", e.replays.timeouts)
	}

	// Listed again only with include_replayed, marked.
	resp, err := e.client.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetDeadLetters()) != 1 || resp.GetDeadLetters()[0].GetId() == d.ID {
		t.Errorf("replayed dead letter still listed as open: %v", ids(resp.GetDeadLetters()))
	}
	g, err := e.client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: d.ID})
	if err != nil || g.GetDeadLetter().GetReplayedAt() == nil {
		t.Errorf("get after replay: %v, %v", g, err)
	}
}

func TestDeadLetterReplayConcurrentStartsOneRun(t *testing.T) {
	e := newDLEnv(t)
	d := e.add(t, md.DefaultTenant, "run-1", RootNode)
	const n = 8
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		runs    = map[string]int{}
		created int
	)
	for range n {
		wg.Go(func() {
			resp, err := e.client.ReplayDeadLetter(context.Background(), &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID})
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			runs[resp.GetRunId()]++
			if resp.GetCreated() {
				created++
			}
		})
	}
	wg.Wait()
	if _, started := e.replays.counts(); started != 1 || len(runs) != 1 || created != 1 {
		t.Errorf("%d concurrent replays: %d runs started, run ids %v, %d created; want one run", n, started, runs, created)
	}
	got, err := e.st.GetDeadLetter(context.Background(), md.DefaultTenant, d.ID)
	if err != nil || got.ReplayCount != 1 {
		t.Errorf("replay count %d, %v; want 1", got.ReplayCount, err)
	}
}

func TestDeadLetterReplayErrors(t *testing.T) {
	e := newDLEnv(t)
	ctx := context.Background()
	_, err := e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "id")
	_, err = e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: uuid.NewString()})
	meshtest.WantCode(t, err, codes.NotFound, "not found")
	_, err = e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: "no-such-id"})
	meshtest.WantCode(t, err, codes.NotFound)
	d := e.add(t, md.DefaultTenant, "run-1", RootNode)
	_, err = e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID, Timeout: durationpb.New(-time.Second)})
	meshtest.WantCode(t, err, codes.InvalidArgument, "timeout")
	if calls, _ := e.replays.counts(); calls != 0 {
		t.Errorf("replayer called %d times for refused requests", calls)
	}
	if e.depth(t, md.DefaultTenant) != 1 {
		t.Error("a refused replay marked the dead letter")
	}

	// The replayer's status is passed on; the mark stays, and a retry starts the run.
	e.replays.failOnce(status.Error(codes.ResourceExhausted, "too many runs"))
	_, err = e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID})
	meshtest.WantCode(t, err, codes.ResourceExhausted, "too many runs")
	if e.depth(t, md.DefaultTenant) != 0 {
		t.Error("the dead letter is marked before the replay starts")
	}
	resp, err := e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d.ID})
	if err != nil || !resp.GetCreated() || resp.GetDeadLetter().GetReplayCount() != 1 {
		t.Errorf("retry after a failed start: %v, %v; want the run started now", resp, err)
	}

	// A plain error is mapped, without its text.
	d2 := e.add(t, md.DefaultTenant, "run-2", RootNode)
	e.replays.failOnce(errors.New("pq: relation \"runs\" does not exist"))
	_, err = e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d2.ID})
	meshtest.WantCode(t, err, codes.Unavailable)
	if strings.Contains(status.Convert(err).Message(), "relation") {
		t.Errorf("internal error text sent to the client: %v", err)
	}

	// No replayer configured.
	_, err = NewDeadLetterServer(e.st, nil).ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: d2.ID})
	meshtest.WantCode(t, err, codes.Unimplemented)
}

func TestDeadLetterGet(t *testing.T) {
	e := newDLEnv(t)
	ctx := context.Background()
	d := e.add(t, md.DefaultTenant, "run-1", "root/s1.t0")
	resp, err := e.client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: d.ID})
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetDeadLetter()
	if g.GetId() != d.ID || g.GetStep() != "root/s1.t0" || string(g.GetPayload()) != string(d.Payload) ||
		g.GetCreatedAt() == nil || g.GetReplayedAt() != nil {
		t.Errorf("get: %v", g)
	}
	_, err = e.client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "id is required")
	_, err = e.client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: uuid.NewString()})
	meshtest.WantCode(t, err, codes.NotFound, "not found")
}

func TestDeadLetterPurge(t *testing.T) {
	e := newDLEnv(t)
	ctx := context.Background()
	a := e.add(t, md.DefaultTenant, "run-a", RootNode)
	b := e.add(t, md.DefaultTenant, "run-b", RootNode)
	c := e.add(t, md.DefaultTenant, "run-c", RootNode)
	e.add(t, md.DefaultTenant, "run-d", RootNode)

	_, err := e.client.PurgeDeadLetters(ctx, &orchestratorv1.PurgeDeadLettersRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "at least one of id, before and only_replayed")
	// The Unix epoch is the store's "no time": it must not turn into "everything".
	_, err = e.client.PurgeDeadLetters(ctx, &orchestratorv1.PurgeDeadLettersRequest{Before: timestamppb.New(time.Unix(0, 0))})
	meshtest.WantCode(t, err, codes.InvalidArgument, "before")
	_, err = e.client.PurgeDeadLetters(ctx, &orchestratorv1.PurgeDeadLettersRequest{Before: &timestamppb.Timestamp{Nanos: -1}})
	meshtest.WantCode(t, err, codes.InvalidArgument, "before")
	if e.depth(t, md.DefaultTenant) != 4 {
		t.Fatal("a refused purge deleted something")
	}

	purge := func(req *orchestratorv1.PurgeDeadLettersRequest) int64 {
		t.Helper()
		resp, err := e.client.PurgeDeadLetters(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetPurged()
	}
	if n := purge(&orchestratorv1.PurgeDeadLettersRequest{Id: a.ID}); n != 1 {
		t.Errorf("purge by id: %d", n)
	}
	_, err = e.client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: a.ID})
	meshtest.WantCode(t, err, codes.NotFound)

	if _, err := e.client.ReplayDeadLetter(ctx, &orchestratorv1.ReplayDeadLetterRequest{Id: b.ID}); err != nil {
		t.Fatal(err)
	}
	if n := purge(&orchestratorv1.PurgeDeadLettersRequest{OnlyReplayed: true}); n != 1 {
		t.Errorf("purge only_replayed: %d, want 1", n)
	}
	if n := purge(&orchestratorv1.PurgeDeadLettersRequest{Before: timestamppb.New(c.CreatedAt.Add(-time.Hour))}); n != 0 {
		t.Errorf("purge before an hour before the oldest: %d, want 0", n)
	}
	if n := purge(&orchestratorv1.PurgeDeadLettersRequest{Before: timestamppb.New(time.Now().Add(time.Minute))}); n != 2 {
		t.Errorf("purge before now: %d, want the 2 left", n)
	}
	if e.depth(t, md.DefaultTenant) != 0 {
		t.Error("dead letters left after purging all")
	}
}

func TestDeadLetterStoreFailureIsUnavailable(t *testing.T) {
	e := newDLEnv(t)
	if err := e.st.Close(); err != nil {
		t.Fatal(err)
	}
	_, err := e.client.ListDeadLetters(context.Background(), &orchestratorv1.ListDeadLettersRequest{})
	meshtest.WantCode(t, err, codes.Unavailable, "dead letter store unavailable")
	if msg := status.Convert(err).Message(); strings.Contains(msg, "sql") || strings.Contains(msg, "closed") {
		t.Errorf("store error text sent to the client: %q", msg)
	}
}
