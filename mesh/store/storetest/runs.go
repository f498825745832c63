package storetest

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const (
	tenantA = "tenant-a"
	tenantB = "tenant-b"
)

func (e *env) create(tenant, key, owner string) store.Run {
	e.t.Helper()
	r, _, err := e.s.CreateRun(e.ctx, store.NewRun{
		Tenant: tenant, IdempotencyKey: key, Task: []byte(`{"steps":[{"answer_tokens":5}]}`), Model: "sim",
		Deadline: e.clock.Now().Add(time.Minute), Owner: owner, LeaseTTL: 10 * time.Second,
	})
	if err != nil {
		e.t.Fatalf("create run: %v", err)
	}
	return r
}

func (e *env) claim(tenant, runID, owner string, ttl time.Duration) store.Run {
	e.t.Helper()
	r, err := e.s.ClaimRun(e.ctx, tenant, runID, owner, ttl)
	if err != nil {
		e.t.Fatalf("claim %s by %s: %v", runID, owner, err)
	}
	return r
}

func wantErr(t tb, err, want error, what string) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: error %v, want %v", what, err, want)
	}
}

// tb is the part of testing.TB the helpers use, so they also run in goroutines'
// reporting wrappers.
type tb interface {
	Helper()
	Fatalf(format string, args ...any)
}

var runTests = map[string]func(*env){
	"CreateAndGet": func(e *env) {
		deadline := e.clock.Now().Add(90 * time.Second)
		r, created, err := e.s.CreateRun(e.ctx, store.NewRun{
			Tenant: tenantA, Task: []byte(`{"plan":1}`), Model: "sim", Deadline: deadline,
		})
		if err != nil || !created {
			e.t.Fatalf("create: created=%v err=%v", created, err)
		}
		if r.RunID == "" || r.Status != store.StatusPending || r.Epoch != 0 || r.Owner != "" || !r.LeaseExpires.IsZero() {
			e.t.Fatalf("new run %+v: want an ID, pending, epoch 0, unowned", r)
		}
		if !r.Deadline.Equal(deadline) || !r.CreatedAt.Equal(e.clock.Now()) || !r.EndedAt.IsZero() {
			e.t.Fatalf("times: deadline %v created %v ended %v", r.Deadline, r.CreatedAt, r.EndedAt)
		}
		got, err := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if err != nil {
			e.t.Fatal(err)
		}
		if got.RunID != r.RunID || got.Tenant != tenantA || string(got.Task) != `{"plan":1}` || got.Model != "sim" ||
			!got.Deadline.Equal(deadline) || got.Status != store.StatusPending {
			e.t.Fatalf("get %+v, want %+v", got, r)
		}
		_, err = e.s.GetRun(e.ctx, tenantB, r.RunID)
		wantErr(e.t, err, store.ErrNotFound, "another tenant's run")
		_, err = e.s.GetRun(e.ctx, tenantA, "nope")
		wantErr(e.t, err, store.ErrNotFound, "unknown run")
	},
	"CreateValidates": func(e *env) {
		_, _, err := e.s.CreateRun(e.ctx, store.NewRun{Deadline: e.clock.Now()})
		wantErr(e.t, err, store.ErrInvalidArgument, "no tenant")
		_, _, err = e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA})
		wantErr(e.t, err, store.ErrInvalidArgument, "no deadline")
		_, _, err = e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: e.clock.Now(), Owner: "o"})
		wantErr(e.t, err, store.ErrInvalidArgument, "owner without TTL")
	},
	"CreateClaimed": func(e *env) {
		r := e.create(tenantA, "", "orch-1")
		if r.Status != store.StatusRunning || r.Owner != "orch-1" || r.Epoch != 1 ||
			!r.LeaseExpires.Equal(e.clock.Now().Add(10*time.Second)) {
			e.t.Fatalf("run created with owner: %+v", r)
		}
	},
	"CallerRunIDTaken": func(e *env) {
		r := e.create(tenantA, "", "")
		_, _, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, RunID: r.RunID, Deadline: e.clock.Now()})
		wantErr(e.t, err, store.ErrAlreadyExists, "taken run ID")
	},
	"IdempotencyKey": func(e *env) {
		r1 := e.create(tenantA, "start-1", "")
		r2, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, IdempotencyKey: "start-1", Deadline: e.clock.Now()})
		if err != nil || created || r2.RunID != r1.RunID || r2.IdempotencyKey != "start-1" {
			e.t.Fatalf("second create with the key: run %s created=%v err=%v, want %s, false", r2.RunID, created, err, r1.RunID)
		}
		r3, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantB, IdempotencyKey: "start-1", Deadline: e.clock.Now()})
		if err != nil || !created || r3.RunID == r1.RunID {
			e.t.Fatalf("same key in another tenant: created=%v err=%v: keys are per tenant", created, err)
		}
		r4, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: e.clock.Now()})
		r5, created2, err2 := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: e.clock.Now()})
		if err != nil || err2 != nil || !created || !created2 || r4.RunID == r5.RunID {
			e.t.Fatal("runs without a key are never deduplicated")
		}
	},
	"InputKept": func(e *env) {
		// The input is opaque bytes, kept as given by every read: the key's lookup, a get,
		// a list, a claim (a takeover resumes the run with it) and a finish.
		input := []byte{0x0a, 0x00, 0xff, 0x10, 0x07}
		r, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, IdempotencyKey: "in-1", Task: []byte("t"),
			Model: "gpt", Input: input, Deadline: e.clock.Now().Add(time.Minute)})
		if err != nil || !created || !bytes.Equal(r.Input, input) {
			e.t.Fatalf("create: input %x created=%v err=%v, want %x", r.Input, created, err, input)
		}
		again, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, IdempotencyKey: "in-1",
			Input: []byte("other"), Deadline: e.clock.Now().Add(time.Minute)})
		if err != nil || created || !bytes.Equal(again.Input, input) {
			e.t.Fatalf("create with the key: input %x created=%v err=%v, want the first run's %x", again.Input, created, err, input)
		}
		got, err := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if err != nil || !bytes.Equal(got.Input, input) {
			e.t.Fatalf("get: input %x err=%v, want %x", got.Input, err, input)
		}
		runs, _, err := e.s.ListRuns(e.ctx, store.RunQuery{Tenant: tenantA})
		if err != nil || len(runs) != 1 || !bytes.Equal(runs[0].Input, input) {
			e.t.Fatalf("list: %d runs err=%v", len(runs), err)
		}
		c := e.claim(tenantA, r.RunID, "orch-a", 10*time.Second)
		if !bytes.Equal(c.Input, input) {
			e.t.Fatalf("claim: input %x, want %x", c.Input, input)
		}
		f, err := e.s.FinishRun(e.ctx, c.Lease(), store.RunResult{Status: store.StatusSucceeded, Answer: []byte("a")})
		if err != nil || !bytes.Equal(f.Input, input) {
			e.t.Fatalf("finish: input %x err=%v, want %x", f.Input, err, input)
		}
		plain := e.create(tenantA, "", "")
		if len(plain.Input) != 0 {
			e.t.Fatalf("a run created without input has input %x", plain.Input)
		}
	},
	"IdempotencyKeyConcurrent": func(e *env) {
		// Two replicas (two Stores on one database), 8 callers each.
		stores := []store.Store{e.s, e.open()}
		const n = 16
		var (
			mu      sync.Mutex
			ids     = map[string]int{}
			created atomic.Int32
			errs    []error
		)
		parallel(n, func(i int) {
			r, c, err := stores[i%2].CreateRun(e.ctx, store.NewRun{
				Tenant: tenantA, IdempotencyKey: "dup", Deadline: e.clock.Now().Add(time.Minute),
			})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			ids[r.RunID]++
			if c {
				created.Add(1)
			}
		})
		if len(errs) > 0 || len(ids) != 1 || created.Load() != 1 {
			e.t.Fatalf("%d concurrent creates with one key: runs %v, created %d, errors %v; want one run, created once",
				n, ids, created.Load(), errs)
		}
		runs, _, err := e.s.ListRuns(e.ctx, store.RunQuery{Tenant: tenantA})
		if err != nil || len(runs) != 1 {
			e.t.Fatalf("list: %d runs, %v", len(runs), err)
		}
	},
	"ListPagesNewestFirst": func(e *env) {
		var ids []string
		for range 7 {
			ids = append(ids, e.create(tenantA, "", "").RunID)
		}
		e.create(tenantB, "", "")
		claimed := e.claim(tenantA, ids[3], "o", time.Second)
		var got []string
		after := ""
		for page := 0; ; page++ {
			runs, next, err := e.s.ListRuns(e.ctx, store.RunQuery{Tenant: tenantA, After: after, Limit: 3})
			if err != nil {
				e.t.Fatal(err)
			}
			if page > 3 || len(runs) > 3 {
				e.t.Fatalf("page %d has %d runs", page, len(runs))
			}
			for _, r := range runs {
				got = append(got, r.RunID)
			}
			if next == "" {
				break
			}
			after = next
		}
		if len(got) != 7 {
			e.t.Fatalf("listed %d runs of tenant A, want 7", len(got))
		}
		for i := range got {
			if got[i] != ids[6-i] {
				e.t.Fatalf("list order %v, want newest first %v", got, ids)
			}
		}
		runs, _, err := e.s.ListRuns(e.ctx, store.RunQuery{Tenant: tenantA, Status: store.StatusRunning})
		if err != nil || len(runs) != 1 || runs[0].RunID != claimed.RunID {
			e.t.Fatalf("status filter: %d runs, %v", len(runs), err)
		}
		_, _, err = e.s.ListRuns(e.ctx, store.RunQuery{})
		wantErr(e.t, err, store.ErrInvalidArgument, "list without tenant")
	},
	"Finish": func(e *env) {
		r := e.create(tenantA, "", "orch-1")
		e.clock.Advance(time.Second)
		_, err := e.s.FinishRun(e.ctx, r.Lease(), store.RunResult{Status: store.StatusRunning})
		wantErr(e.t, err, store.ErrInvalidArgument, "non-terminal status")
		res := store.RunResult{Status: store.StatusSucceeded, Answer: []byte("42"), Summary: []byte{0, 1, 2, 0xff}}
		f, err := e.s.FinishRun(e.ctx, r.Lease(), res)
		if err != nil {
			e.t.Fatal(err)
		}
		if f.Status != store.StatusSucceeded || string(f.Answer) != "42" || !f.EndedAt.Equal(e.clock.Now()) || !f.LeaseExpires.IsZero() {
			e.t.Fatalf("finished run %+v", f)
		}
		if _, err := e.s.FinishRun(e.ctx, r.Lease(), res); err != nil {
			e.t.Fatalf("the same finish again (a retried commit): %v", err)
		}
		_, err = e.s.FinishRun(e.ctx, r.Lease(), store.RunResult{Status: store.StatusFailed, Error: "x"})
		wantErr(e.t, err, store.ErrRunFinished, "finish with another result")
		_, err = e.s.ClaimRun(e.ctx, tenantA, r.RunID, "orch-2", time.Second)
		wantErr(e.t, err, store.ErrRunFinished, "claim a finished run")
		_, err = e.s.HeartbeatRun(e.ctx, r.Lease(), time.Second)
		wantErr(e.t, err, store.ErrRunFinished, "heartbeat a finished run")
		if err := e.s.ReleaseRun(e.ctx, r.Lease()); err != nil {
			e.t.Fatalf("release after finish: %v", err)
		}
		got, _ := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if got.Status != store.StatusSucceeded || string(got.Answer) != "42" || string(got.Summary) != string(res.Summary) {
			e.t.Fatalf("stored %+v", got)
		}
	},
	"FinishFencedAndCause": func(e *env) {
		r := e.create(tenantA, "", "orch-1")
		e.clock.Advance(11 * time.Second)
		r2 := e.claim(tenantA, r.RunID, "orch-2", 10*time.Second)
		_, err := e.s.FinishRun(e.ctx, r.Lease(), store.RunResult{Status: store.StatusSucceeded})
		wantErr(e.t, err, store.ErrStaleEpoch, "finish by the old owner")
		f, err := e.s.FinishRun(e.ctx, r2.Lease(), store.RunResult{Status: store.StatusDeadlineExceeded, Cause: "deadline", Error: "no time left"})
		if err != nil || f.Cause != "deadline" || f.Error != "no time left" || f.Status != store.StatusDeadlineExceeded {
			e.t.Fatalf("finish by the new owner: %+v %v", f, err)
		}
	},
	"DeleteEnded": func(e *env) {
		put := func(r store.Run, step int) {
			m, tl := checkpointBytes(step)
			if err := e.s.PutCheckpoint(e.ctx, r.Lease(), store.Checkpoint{Step: step, ModelOutput: m, ToolResults: tl}); err != nil {
				e.t.Fatal(err)
			}
		}
		r := e.create(tenantA, "start-1", "orch-1")
		kept := e.create(tenantA, "start-2", "orch-1")
		put(r, 0)
		put(r, 1)
		put(kept, 0)
		wantErr(e.t, e.s.DeleteRun(e.ctx, tenantA, r.RunID), store.ErrConflict, "delete a running run")
		pending := e.create(tenantA, "", "")
		wantErr(e.t, e.s.DeleteRun(e.ctx, tenantA, pending.RunID), store.ErrConflict, "delete a pending run")
		for _, run := range []store.Run{r, kept} {
			if _, err := e.s.FinishRun(e.ctx, run.Lease(), store.RunResult{Status: store.StatusSucceeded}); err != nil {
				e.t.Fatal(err)
			}
		}
		wantErr(e.t, e.s.DeleteRun(e.ctx, tenantB, r.RunID), store.ErrNotFound, "delete another tenant's run")
		wantErr(e.t, e.s.DeleteRun(e.ctx, tenantA, "nope"), store.ErrNotFound, "delete an unknown run")
		if err := e.s.DeleteRun(e.ctx, tenantA, r.RunID); err != nil {
			e.t.Fatalf("delete an ended run: %v", err)
		}
		_, err := e.s.GetRun(e.ctx, tenantA, r.RunID)
		wantErr(e.t, err, store.ErrNotFound, "get a deleted run")
		wantErr(e.t, e.s.DeleteRun(e.ctx, tenantA, r.RunID), store.ErrNotFound, "delete it again")
		if cs, err := e.s.ListCheckpoints(e.ctx, tenantA, r.RunID); err != nil || len(cs) != 0 {
			e.t.Fatalf("a deleted run's checkpoints: %d, %v; want none", len(cs), err)
		}
		if cs, err := e.s.ListCheckpoints(e.ctx, tenantA, kept.RunID); err != nil || len(cs) != 1 {
			e.t.Fatalf("another run's checkpoints: %d, %v; want 1", len(cs), err)
		}
		runs, _, err := e.s.ListRuns(e.ctx, store.RunQuery{Tenant: tenantA})
		if err != nil || len(runs) != 2 || runs[0].RunID != pending.RunID || runs[1].RunID != kept.RunID {
			e.t.Fatalf("list after the delete: %d runs, %v; want the pending and the kept run", len(runs), err)
		}
		again, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, IdempotencyKey: "start-1", Deadline: e.clock.Now().Add(time.Minute)})
		if err != nil || !created || again.RunID == r.RunID {
			e.t.Fatalf("create with a deleted run's key: run %s created=%v err=%v; want a new run", again.RunID, created, err)
		}
		same, created, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, IdempotencyKey: "start-2", Deadline: e.clock.Now().Add(time.Minute)})
		if err != nil || created || same.RunID != kept.RunID {
			e.t.Fatalf("create with a kept run's key: run %s created=%v err=%v; want the kept run", same.RunID, created, err)
		}
	},
}

// checkpointBytes is a model output of a typical step: an assistant message with two
// tool calls.
func checkpointBytes(step int) (model, tools []byte) {
	model = fmt.Appendf(nil, `{"role":"assistant","content":"step %d","tool_calls":[`+
		`{"id":"call_%d_0","name":"kv_put","args":{"key":"k%d","value":"v"}},`+
		`{"id":"call_%d_1","name":"notify","args":{"channel":"ops","text":"done"}}]}`, step, step, step, step)
	tools = fmt.Appendf(nil, `[{"id":"call_%d_0","result":"ok"},{"id":"call_%d_1","result":"sent"}]`, step, step)
	return model, tools
}

func sameCheckpoint(a, b store.Checkpoint) bool {
	return a.Step == b.Step && bytes.Equal(a.ModelOutput, b.ModelOutput) && bytes.Equal(a.ToolResults, b.ToolResults) &&
		a.Tokens == b.Tokens
}
