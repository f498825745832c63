package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func openStore(t *testing.T) store.Store {
	t.Helper()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

// privateStore is the store of a server started without --store: private to the
// test's process.
func privateStore(t *testing.T) store.Store { return storetest.OpenMemory(t) }

// deadLetters records into the store, as mesh/dlq.Recorder does without a broker.
type deadLetters struct{ st store.Store }

func (d deadLetters) Record(ctx context.Context, dl store.DeadLetter) (store.DeadLetter, bool, error) {
	return d.st.AddDeadLetter(ctx, dl)
}

func newDurableEnv(t *testing.T, st store.Store, owner string, ttl time.Duration) *env {
	t.Helper()
	return newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		c.Store, c.Owner, c.LeaseTTL, c.DeadLetters = st, owner, ttl, deadLetters{st}
	})
}

// drainStarted empties the fake model's record of started decoders.
func (e *env) decoders() []string {
	var out []string
	for {
		select {
		case n := <-e.model.started:
			out = append(out, n)
		default:
			return out
		}
	}
}

// StartRun with one key twice starts one run, which is recorded, checkpointed and
// finished in the store, and a second server on the same store serves it.
func TestStartRunIdempotentAndStored(t *testing.T) {
	st := openStore(t)
	e := newDurableEnv(t, st, "orch-a", time.Second)
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	req := &orchestratorv1.StartRunRequest{Task: fastPlan, IdempotencyKey: "k-1", Timeout: durationpb.New(10 * time.Second)}
	first, err := e.orch.StartRun(ctx, req)
	if err != nil || !first.GetCreated() {
		t.Fatalf("first StartRun: %v created=%v", err, first.GetCreated())
	}
	second, err := e.orch.StartRun(ctx, req)
	if err != nil || second.GetCreated() || second.GetRun().GetRunId() != first.GetRun().GetRunId() {
		t.Fatalf("second StartRun: %v created=%v run %s, want run %s again", err, second.GetCreated(), second.GetRun().GetRunId(), first.GetRun().GetRunId())
	}
	other := &orchestratorv1.StartRunRequest{Task: tinyPlan, IdempotencyKey: "k-1"}
	_, err = e.orch.StartRun(ctx, other)
	meshtest.WantCode(t, err, codes.AlreadyExists)
	id := first.GetRun().GetRunId()
	if dl := first.GetRun().GetDeadline().AsTime(); time.Until(dl) > 10*time.Second || time.Until(dl) < 8*time.Second {
		t.Errorf("deadline %v is not 10 s from the start", dl)
	}

	// Follow it to the end.
	w, err := e.orch.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(w)
	if err != nil || len(evs) < 2 || evs[0].GetStarted().GetRunId() != id || evs[len(evs)-1].GetFinished() == nil {
		t.Fatalf("watch: %v, %d events", err, len(evs))
	}
	fin := evs[len(evs)-1].GetFinished()
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetEpoch() != 1 {
		t.Fatalf("finished %v epoch %d", fin.GetStatus(), fin.GetEpoch())
	}
	cps, err := st.ListCheckpoints(context.Background(), "acme", id)
	if err != nil || len(cps) != 3 { // model 0, tools 0, model 1
		t.Fatalf("checkpoints: %d, %v", len(cps), err)
	}
	for _, c := range cps {
		if c.Epoch != 1 {
			t.Errorf("checkpoint %d under epoch %d", c.Step, c.Epoch)
		}
	}
	if cps[0].Tokens != 10 || cps[2].Tokens != 5 {
		t.Errorf("checkpoint tokens %d, %d, want 10, 5", cps[0].Tokens, cps[2].Tokens)
	}

	// Another server on the same store: GetRun, ListRuns, WatchRun of an ended run.
	e2 := newDurableEnv(t, st, "orch-b", time.Second)
	got, err := e2.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil || got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || len(got.GetRun().GetNodes()) == 0 ||
		got.GetRun().GetTokens() != fin.GetTokens() || got.GetRun().GetIdempotencyKey() != "k-1" {
		t.Fatalf("GetRun elsewhere: %v %v", err, got.GetRun())
	}
	_, err = e2.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: id}) // the default tenant
	meshtest.WantCode(t, err, codes.NotFound)
	list, err := e2.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(list.GetRuns()) != 1 || list.GetRuns()[0].GetRunId() != id {
		t.Fatalf("ListRuns elsewhere: %v %v", err, list.GetRuns())
	}
	w2, err := e2.orch.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	evs, err = meshtest.Drain(w2)
	if err != nil || len(evs) != 2 || evs[1].GetFinished().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("watch elsewhere: %v %v", err, evs)
	}
}

// A run whose owner died mid-run is taken over once its lease expires, and resumed from
// its checkpoints: its completed model step is not generated again.
func TestTakeoverResumesFromCheckpoints(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	plan := `{"tokens_per_second":200,"steps":[
	  {"think_tokens":4,"tools":[{"name":"sleep","args":{"ms":1}}]},
	  {"think_tokens":3,"tools":[{"name":"sleep","args":{"ms":1}}]},
	  {"answer_tokens":2}]}`
	// A dead owner's run: step 0 complete, step 1's model output recorded.
	run, _, err := st.CreateRun(ctx, store.NewRun{Tenant: "acme", Task: []byte(plan), Model: agent.DefaultModel,
		Deadline: time.Now().Add(20 * time.Second), Owner: "dead", LeaseTTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	entries := []agent.Entry{
		{Step: 0, Kind: agent.EntryModel, Text: "w w w w ", FinishReason: "tool_calls", Tokens: 4,
			ToolCalls: e2eCalls(0, `{"ms":1}`)},
		{Step: 0, Kind: agent.EntryTools, ToolOutputs: []string{`{"ok":true}`}},
		{Step: 1, Kind: agent.EntryModel, Text: "w w w ", FinishReason: "tool_calls", Tokens: 3,
			ToolCalls: e2eCalls(1, `{"ms":1}`)},
	}
	for i, en := range entries {
		b, err := agent.MarshalEntry(en)
		if err != nil {
			t.Fatal(err)
		}
		c := store.Checkpoint{Step: i, Tokens: en.Tokens}
		if en.Kind == agent.EntryModel {
			c.ModelOutput = b
		} else {
			c.ToolResults = b
		}
		if err := st.PutCheckpoint(ctx, run.Lease(), c); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewRegistry()
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		c.Store, c.Owner, c.LeaseTTL, c.DeadLetters, c.Registerer = st, "orch-b", 200*time.Millisecond, deadLetters{st}, reg
	})
	actx := metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme")
	w, err := e.orch.WatchRun(actx, &orchestratorv1.WatchRunRequest{RunId: run.RunID})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(w)
	if err != nil {
		t.Fatal(err)
	}
	fin := evs[len(evs)-1].GetFinished()
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetEpoch() != 2 {
		t.Fatalf("resumed run ended %v at epoch %d: %s", fin.GetStatus(), fin.GetEpoch(), fin.GetErrorMessage())
	}
	if got := e.decoders(); !slices.Equal(got, []string{"root/m2"}) {
		t.Errorf("decoders after takeover: %v, want only root/m2", got)
	}
	cps, _ := st.ListCheckpoints(ctx, "acme", run.RunID)
	var epochs []int64
	for _, c := range cps {
		epochs = append(epochs, c.Epoch)
	}
	if !slices.Equal(epochs, []int64{1, 1, 1, 2, 2}) {
		t.Errorf("checkpoint epochs %v, want the first three by the dead owner and the rest by the new one", epochs)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.takeovers.WithLabelValues(takeoverResumed)); n != 1 {
		t.Errorf("curfew_run_takeovers_total{outcome=resumed} = %v, want 1", n)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.lost); n != 0 {
		t.Errorf("curfew_run_leases_lost_total = %v, want 0", n)
	}
	if n, err := testutil.GatherAndCount(reg, "curfew_run_leases_held", "curfew_run_lease_heartbeat_age_seconds"); err != nil || n != 2 {
		t.Errorf("lease gauges: %d series, %v", n, err)
	}
}

func e2eCalls(step int, args string) []*modelproxyv1.ToolCall {
	return []*modelproxyv1.ToolCall{{Id: fmt.Sprintf("call_%d_0", step), Name: "sleep", ArgsJson: args}}
}

// A run whose deadline passed while it had no owner ends DEADLINE_EXCEEDED and becomes a
// dead letter.
func TestExpiredUnownedRunIsDeadLettered(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	run, _, err := st.CreateRun(ctx, store.NewRun{Tenant: "acme", Task: []byte(tinyPlan), Model: agent.DefaultModel,
		Deadline: time.Now().Add(100 * time.Millisecond), Owner: "dead", LeaseTTL: 50 * time.Millisecond, IdempotencyKey: "late"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(150 * time.Millisecond)
	e := newDurableEnv(t, st, "orch-b", 200*time.Millisecond)
	r := e.waitEndedTenant(t, "acme", run.RunID)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED {
		t.Fatalf("status %v", r.GetStatus())
	}
	dls := waitDeadLetters(t, st, "acme", 1)
	if dls[0].RunID != run.RunID || dls[0].ErrorType != "deadline_exceeded" || dls[0].IdempotencyKey != "late" {
		t.Fatalf("dead letters %+v", dls)
	}
}

// waitDeadLetters waits until the tenant has n dead letters: a run's end is visible (its
// status) a moment before its dead letter is recorded.
func waitDeadLetters(t *testing.T, st store.Store, tenant string, n int) []store.DeadLetter {
	t.Helper()
	until := time.Now().Add(5 * time.Second)
	for {
		dls, _, err := st.ListDeadLetters(context.Background(), store.DeadLetterQuery{Tenant: tenant})
		if err == nil && len(dls) >= n {
			if len(dls) > n {
				t.Fatalf("%d dead letters, want %d", len(dls), n)
			}
			return dls
		}
		if time.Now().After(until) {
			t.Fatalf("%d dead letters after 5s (%v), want %d", len(dls), err, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) waitEndedTenant(t *testing.T, tenant, id string) *orchestratorv1.Run {
	t.Helper()
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, tenant)
	until := time.Now().Add(5 * time.Second)
	for {
		resp, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err == nil && resp.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return resp.GetRun()
		}
		if time.Now().After(until) {
			t.Fatalf("run %s not ended after 5s: %v", id, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A durable run whose step is refused by an open breaker parks and resumes from its
// journal after the breaker's delay instead of failing: the tool is tried again, the
// completed model step is not.
func TestBreakerRefusedStepResumesFromJournal(t *testing.T) {
	st := openStore(t)
	e := newDurableEnv(t, st, "orch-a", time.Second)
	plan := `{"tokens_per_second":500,"steps":[
	  {"think_tokens":3,"tools":[{"name":"fail","args":{"times":2,"code":"UNAVAILABLE","retry_info_ms":50}}]},
	  {"answer_tokens":2}]}`
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r := e.waitEndedTenant(t, md.DefaultTenant, res.GetRun().GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run %v: %s", r.GetStatus(), r.GetErrorMessage())
	}
	if got := e.decoders(); !slices.Equal(got, []string{"root/m0", "root/m1"}) {
		t.Errorf("decoders %v, want each step once", got)
	}
	if n := e.tools.call(md.Identity{RunID: r.GetRunId(), NodeID: "root/s0.t0"}); n != 3 {
		t.Errorf("refused tool called %d times, want 3 (two refusals, then success)", n)
	}
}

// Any other failure fails the durable run (one retrying layer: the call's own retries
// were spent), and so does a refusal in a step with a side effect that has no key.
func TestOtherFailuresFailDurableRun(t *testing.T) {
	st := openStore(t)
	e := newDurableEnv(t, st, "orch-a", time.Second)
	for name, plan := range map[string]string{
		"unavailable": `{"tokens_per_second":500,"steps":[
		  {"think_tokens":3,"tools":[{"name":"fail","args":{"times":1,"code":"UNAVAILABLE"}}]},
		  {"answer_tokens":2}]}`,
		"deploy sibling": `{"tokens_per_second":500,"steps":[
		  {"think_tokens":3,"tools":[{"name":"deploy","args":{"duration_ms":1}},
		                             {"name":"fail","args":{"times":1,"code":"UNAVAILABLE","retry_info_ms":50}}]},
		  {"answer_tokens":2}]}`,
	} {
		res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(20 * time.Second)})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		r := e.waitEndedTenant(t, md.DefaultTenant, res.GetRun().GetRunId())
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || r.GetErrorCode() != "UNAVAILABLE" {
			t.Errorf("%s: run %v %s, want failed UNAVAILABLE", name, r.GetStatus(), r.GetErrorCode())
		}
	}
	waitDeadLetters(t, st, md.DefaultTenant, 2) // one per failed run
}

// On a private store there is no journal to resume from: a refusal fails the run.
func TestBreakerRefusalFailsOnPrivateStore(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	plan := `{"tokens_per_second":500,"steps":[
	  {"think_tokens":3,"tools":[{"name":"fail","args":{"times":1,"code":"UNAVAILABLE","retry_info_ms":50}}]},
	  {"answer_tokens":2}]}`
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: plan})
	if err != nil {
		t.Fatal(err)
	}
	r := e.waitEndedTenant(t, md.DefaultTenant, res.GetRun().GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || r.GetErrorCode() != "UNAVAILABLE" {
		t.Fatalf("run %v %s", r.GetStatus(), r.GetErrorCode())
	}
}

// On a private store, StartRun's key still names one run.
func TestStartRunIdempotentOnPrivateStore(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	req := &orchestratorv1.StartRunRequest{Task: tinyPlan, IdempotencyKey: "mem-1"}
	a, err := e.orch.StartRun(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.orch.StartRun(context.Background(), req)
	if err != nil || !a.GetCreated() || b.GetCreated() || a.GetRun().GetRunId() != b.GetRun().GetRunId() {
		t.Fatalf("%v: %s/%v then %s/%v", err, a.GetRun().GetRunId(), a.GetCreated(), b.GetRun().GetRunId(), b.GetCreated())
	}
	_, err = e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: fastPlan, IdempotencyKey: "mem-1"})
	meshtest.WantCode(t, err, codes.AlreadyExists)
	_, err = e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(-time.Second)})
	meshtest.WantCode(t, err, codes.InvalidArgument)
	e.waitEndedTenant(t, md.DefaultTenant, a.GetRun().GetRunId())
}

// A run whose lease another orchestrator has claimed stops advancing here: its next
// fenced write (heartbeat or checkpoint) is refused, it ends on this process without a
// result, and nothing of it is written under the old epoch after the claim.
func TestStaleEpochStopsTheRunHere(t *testing.T) {
	st := openStore(t)
	reg := prometheus.NewRegistry()
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		c.Store, c.Owner, c.LeaseTTL, c.DeadLetters, c.Registerer = st, "orch-a", 600*time.Millisecond, deadLetters{st}, reg
	})
	plan := `{"tokens_per_second":200,"steps":[
	  {"think_tokens":2,"tools":[{"name":"sleep","args":{"ms":1500}}]},
	  {"think_tokens":2,"tools":[{"name":"sleep","args":{"ms":1}}]},
	  {"answer_tokens":2}]}`
	ctx := context.Background()
	res, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := res.GetRun().GetRunId()
	for until := time.Now().Add(5 * time.Second); ; { // in step 0's sleep: its model output is recorded
		cps, _ := st.ListCheckpoints(ctx, md.DefaultTenant, id)
		if len(cps) == 1 {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("%d checkpoints, want step 0's model output", len(cps))
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Another orchestrator takes the run: release a's lease behind its back, claim it.
	run, err := st.GetRun(ctx, md.DefaultTenant, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.ReleaseRun(ctx, run.Lease()); err != nil {
		t.Fatal(err)
	}
	other, err := st.ClaimRun(ctx, md.DefaultTenant, id, "orch-b", time.Minute)
	if err != nil || other.Epoch != 2 {
		t.Fatalf("claim: epoch %d, %v", other.Epoch, err)
	}
	for until := time.Now().Add(5 * time.Second); testutil.ToFloat64(e.srv.leaseMetrics.lost) != 1; {
		if time.Now().After(until) {
			t.Fatal("orchestrator a did not stop the run it lost")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(1700 * time.Millisecond) // past the sleep: a would have written step 0's tools and step 1
	got, err := st.GetRun(ctx, md.DefaultTenant, id)
	if err != nil || got.Status.Terminal() || got.Owner != "orch-b" || got.Epoch != 2 {
		t.Fatalf("run after a lost it: %s owner %q epoch %d (%v), want still running, b's", got.Status, got.Owner, got.Epoch, err)
	}
	cps, _ := st.ListCheckpoints(ctx, md.DefaultTenant, id)
	if len(cps) != 1 || cps[0].Epoch != 1 {
		t.Fatalf("checkpoints %+v, want only step 0's model output, written under epoch 1", cps)
	}
	if got := e.decoders(); !slices.Equal(got, []string{"root/m0"}) {
		t.Errorf("decoders %v: a must not go on to step 1", got)
	}
}

// blockingFinish is a real store whose FinishRun waits until released: the window
// between a run's recorded end and its commit, held open.
type blockingFinish struct {
	store.Store
	entered, release chan struct{}
}

func (b *blockingFinish) FinishRun(ctx context.Context, l store.Lease, res store.RunResult) (store.Run, error) {
	close(b.entered)
	<-b.release
	return b.Store.FinishRun(ctx, l, res)
}

// GetRun of a run whose end is recorded while its result is still being stored serves
// the final summary, with the token figures split at the cancel instant, not a live read.
func TestGetRunWhileTheResultIsStored(t *testing.T) {
	bf := &blockingFinish{Store: openStore(t), entered: make(chan struct{}), release: make(chan struct{})}
	e := newDurableEnv(t, bf, "orch-a", time.Second)
	ctx := context.Background()
	res, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: slowPlan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	e.waitDecoder(t)
	time.Sleep(200 * time.Millisecond) // some tokens before the cancel
	cancelled := make(chan error, 1)
	go func() {
		_, err := e.orch.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: res.GetRun().GetRunId()})
		cancelled <- err
	}()
	select {
	case <-bf.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the run's result was never stored")
	}
	got, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: res.GetRun().GetRunId()})
	close(bf.release)
	if err != nil {
		t.Fatal(err)
	}
	if got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("status %v", got.GetRun().GetStatus())
	}
	m := nodeOf(t, got.GetRun(), "root/m0")
	if m.GetTokensAtCancel() == 0 || m.GetTokensAtCancel()+m.GetTokensAfterCancel() != m.GetTokens() {
		t.Errorf("decoder figures %d at + %d after != %d: the summary lost its split at the cancel", m.GetTokensAtCancel(), m.GetTokensAfterCancel(), m.GetTokens())
	}
	if err := <-cancelled; err != nil {
		t.Fatal(err)
	}
}

// outageFinish is a real store whose FinishRun fails while down, as PostgreSQL's does
// while it restarts.
type outageFinish struct {
	store.Store
	down    atomic.Bool
	refused atomic.Int64
}

func (o *outageFinish) FinishRun(ctx context.Context, l store.Lease, res store.RunResult) (store.Run, error) {
	if o.down.Load() {
		o.refused.Add(1)
		return store.Run{}, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	}
	return o.Store.FinishRun(ctx, l, res)
}

// A run that ends while its result cannot be stored is not run again once its lease
// lapses: its client saw it end, so the result it ended with is stored once the store
// takes it, and no decoder starts for it a second time.
func TestResultStoredAfterTheStoreComesBack(t *testing.T) {
	st := &outageFinish{Store: openStore(t)}
	st.down.Store(true)
	e := newDurableEnv(t, st, "orch-a", 300*time.Millisecond)
	ctx := context.Background()
	res, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: `{"steps": [{"answer_tokens": 3}]}`, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := res.GetRun().GetRunId()
	for until := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		got, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err == nil && got.GetRun().GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the run did not end: %v %v", got, err)
		}
	}
	time.Sleep(time.Second) // several lease TTLs: a lapsed lease must not resume it
	if st.refused.Load() < 2 {
		t.Fatalf("FinishRun tried %d times while the store was down, want retries", st.refused.Load())
	}
	st.down.Store(false)
	for until := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := st.GetRun(ctx, md.DefaultTenant, id)
		if err == nil && r.Status.Terminal() {
			if r.Status != store.StatusSucceeded {
				t.Fatalf("stored %s, want the SUCCEEDED its client saw", r.Status)
			}
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the result was never stored: %+v %v", r, err)
		}
	}
	if got := e.decoders(); len(got) != 1 {
		t.Fatalf("decoders %v: the run was run again", got)
	}
}
