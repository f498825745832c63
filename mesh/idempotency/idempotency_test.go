package idempotency_test

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/idempotency"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// backends runs fn against SQLite, the real PostgreSQL and a memory store.
func backends(t *testing.T, fn func(t *testing.T, s store.Store)) {
	for _, b := range []struct {
		name string
		dsn  func(t *testing.T) string
	}{
		{"sqlite", func(t *testing.T) string { return filepath.Join(t.TempDir(), "curfew.db") }},
		{"postgres", func(t *testing.T) string { return storetest.PostgresDSN(t) }},
		{"memory", func(t *testing.T) string { return storetest.MemoryDSN(t) }},
	} {
		t.Run(b.name, func(t *testing.T) {
			s, err := store.Open(context.Background(), b.dsn(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			fn(t, s)
		})
	}
}

func executor(t *testing.T, s store.Store, owner string, ttl time.Duration) *idempotency.Executor {
	t.Helper()
	e, err := idempotency.New(idempotency.Config{Store: s, Owner: owner, LeaseTTL: ttl, MaxPoll: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// The effect happens once: a second call with the key replays the stored result, and
// the kv entry and the outbox row were written once.
func TestDoOnceThenReplay(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		ctx := ctxT(t)
		e := executor(t, s, "owner-a", time.Second)
		var runs atomic.Int32
		fn := func(context.Context) (idempotency.Result, error) {
			runs.Add(1)
			return idempotency.Result{Value: []byte(`{"ok":true}`), Effects: []store.Effect{
				store.KVPut{Key: "greeting", Value: []byte("hello")}, store.Notify{Channel: "ops", Payload: []byte("deployed")}}}, nil
		}
		c := idempotency.Call{Tenant: "t1", Key: "k1", RunID: "r1", Tool: "kv_put"}
		v, o, err := e.Do(ctx, c, fn)
		if err != nil || o != idempotency.Executed || string(v) != `{"ok":true}` {
			t.Fatalf("first: %s %v %v", v, o, err)
		}
		v, o, err = e.Do(ctx, c, fn)
		if err != nil || o != idempotency.Replayed || string(v) != `{"ok":true}` {
			t.Fatalf("second: %s %v %v", v, o, err)
		}
		if runs.Load() != 1 {
			t.Fatalf("ran %d times", runs.Load())
		}
		kv, err := s.GetKV(ctx, "t1", "greeting")
		if err != nil || string(kv.Value) != "hello" || kv.Version != 1 {
			t.Fatalf("kv %+v %v", kv, err)
		}
		out, err := s.ListOutbox(ctx, "t1", 0, 0)
		if err != nil || len(out) != 1 {
			t.Fatalf("outbox %+v %v", out, err)
		}
	})
}

// Duplicates racing the first call join it: the function runs once and all get its result.
func TestConcurrentDuplicatesJoin(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		ctx := ctxT(t)
		var runs atomic.Int32
		fn := func(context.Context) (idempotency.Result, error) {
			runs.Add(1)
			time.Sleep(150 * time.Millisecond)
			return idempotency.Result{Value: []byte("v"), Effects: []store.Effect{store.Notify{Channel: "c", Payload: []byte("once")}}}, nil
		}
		var wg sync.WaitGroup
		outcomes := make(chan idempotency.Outcome, 10)
		for i := range 10 {
			e := executor(t, s, "owner-"+string(rune('a'+i)), 5*time.Second)
			wg.Go(func() {
				v, o, err := e.Do(ctx, idempotency.Call{Tenant: "t1", Key: "dup"}, fn)
				if err != nil || string(v) != "v" {
					t.Errorf("call %d: %s %v", i, v, err)
				}
				outcomes <- o
			})
		}
		wg.Wait()
		close(outcomes)
		n := map[idempotency.Outcome]int{}
		for o := range outcomes {
			n[o]++
		}
		if runs.Load() != 1 || n[idempotency.Executed] != 1 || n[idempotency.Joined]+n[idempotency.Replayed] != 9 {
			t.Fatalf("ran %d times; outcomes %v", runs.Load(), n)
		}
		if out, _ := s.ListOutbox(ctx, "t1", 0, 0); len(out) != 1 {
			t.Fatalf("outbox has %d rows", len(out))
		}
	})
}

// A record left in progress by a crashed owner is taken over once its lease expires.
func TestTakeoverAfterCrash(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		ctx := ctxT(t)
		b, err := s.BeginTool(ctx, store.ToolBegin{Tenant: "t1", Key: "crashed", Owner: "dead-process", TTL: 300 * time.Millisecond})
		if err != nil || b.Outcome != store.BeginStarted {
			t.Fatalf("crashed owner's begin: %+v %v", b, err)
		}
		e := executor(t, s, "live-process", 5*time.Second)
		start := time.Now()
		v, o, err := e.Do(ctx, idempotency.Call{Tenant: "t1", Key: "crashed"}, func(context.Context) (idempotency.Result, error) {
			return idempotency.Result{Value: []byte("recovered")}, nil
		})
		if err != nil || o != idempotency.Executed || string(v) != "recovered" {
			t.Fatalf("takeover: %s %v %v", v, o, err)
		}
		if waited := time.Since(start); waited < 200*time.Millisecond {
			t.Fatalf("took over after %v, before the crashed owner's lease expired", waited)
		}
		rec, err := s.GetTool(ctx, "t1", "crashed")
		if err != nil || rec.Epoch != 2 || rec.Owner != "live-process" || rec.Status != store.ToolDone {
			t.Fatalf("record %+v %v", rec, err)
		}
	})
}

// A retryable failure releases the record (the next attempt runs at once); a permanent
// one is stored and replayed without running again.
func TestFailures(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		ctx := ctxT(t)
		e := executor(t, s, "o", 10*time.Second)
		var runs atomic.Int32
		c := idempotency.Call{Tenant: "t1", Key: "flaky"}
		_, _, err := e.Do(ctx, c, func(context.Context) (idempotency.Result, error) {
			runs.Add(1)
			return idempotency.Result{}, status.Error(codes.Unavailable, "backend down")
		})
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("first: %v", err)
		}
		start := time.Now()
		v, o, err := e.Do(ctx, c, func(context.Context) (idempotency.Result, error) {
			runs.Add(1)
			return idempotency.Result{Value: []byte("ok")}, nil
		})
		if err != nil || o != idempotency.Executed || string(v) != "ok" || runs.Load() != 2 || time.Since(start) > 5*time.Second {
			t.Fatalf("retry: %s %v %v, %d runs, %v", v, o, err, runs.Load(), time.Since(start))
		}

		p := idempotency.Call{Tenant: "t1", Key: "bad"}
		_, _, err = e.Do(ctx, p, func(context.Context) (idempotency.Result, error) {
			return idempotency.Result{}, status.Error(codes.InvalidArgument, "args.ms: must be positive")
		})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("permanent: %v", err)
		}
		_, o, err = e.Do(ctx, p, func(context.Context) (idempotency.Result, error) {
			t.Error("a stored failure ran again")
			return idempotency.Result{}, nil
		})
		if status.Code(err) != codes.InvalidArgument || o != idempotency.Replayed {
			t.Fatalf("replayed failure: %v %v", o, err)
		}
	})
}

// A call cancelled while it runs releases its record: the next attempt does not wait for
// the lease.
func TestCancelledCallReleases(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		e := executor(t, s, "o", 30*time.Second)
		ctx, cancel := context.WithCancel(ctxT(t))
		started := make(chan struct{})
		go func() { <-started; cancel() }()
		_, _, err := e.Do(ctx, idempotency.Call{Tenant: "t1", Key: "c"}, func(ctx context.Context) (idempotency.Result, error) {
			close(started)
			<-ctx.Done()
			return idempotency.Result{}, status.FromContextError(ctx.Err()).Err()
		})
		if status.Code(err) != codes.Canceled {
			t.Fatalf("cancelled: %v", err)
		}
		start := time.Now()
		_, o, err := e.Do(ctxT(t), idempotency.Call{Tenant: "t1", Key: "c"}, func(context.Context) (idempotency.Result, error) {
			return idempotency.Result{Value: []byte("second")}, nil
		})
		if err != nil || o != idempotency.Executed || time.Since(start) > 5*time.Second {
			t.Fatalf("after a cancel: %v %v in %v", o, err, time.Since(start))
		}
	})
}

// A long call keeps its record by heartbeats: a duplicate arriving after several lease
// periods joins instead of taking over.
func TestHeartbeatKeepsLongCall(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		ctx := ctxT(t)
		var runs atomic.Int32
		fn := func(context.Context) (idempotency.Result, error) {
			runs.Add(1)
			time.Sleep(900 * time.Millisecond)
			return idempotency.Result{Value: []byte("long")}, nil
		}
		first := executor(t, s, "first", 300*time.Millisecond)
		second := executor(t, s, "second", 300*time.Millisecond)
		done := make(chan error, 1)
		go func() { _, _, err := first.Do(ctx, idempotency.Call{Tenant: "t1", Key: "long"}, fn); done <- err }()
		time.Sleep(600 * time.Millisecond) // two lease periods
		v, o, err := second.Do(ctx, idempotency.Call{Tenant: "t1", Key: "long"}, fn)
		if err != nil || o != idempotency.Joined || string(v) != "long" {
			t.Fatalf("duplicate: %s %v %v", v, o, err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if runs.Load() != 1 {
			t.Fatalf("ran %d times", runs.Load())
		}
	})
}

func TestDeriveKey(t *testing.T) {
	a, err := idempotency.DeriveKey("run", "root/s0.t0", "kv_put", []byte(`{"key": "a", "value": {"y": 2, "x": 1.50}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := idempotency.DeriveKey("run", "root/s0.t0", "kv_put", []byte("{\"value\":{\"x\":1.50,\"y\":2},\n \"key\":\"a\"}"))
	if a != b {
		t.Fatalf("key order and whitespace changed the key: %s %s", a, b)
	}
	for _, other := range [][4]string{
		{"run2", "root/s0.t0", "kv_put", `{"key":"a","value":{"x":1.50,"y":2}}`},
		{"run", "root/s0.t1", "kv_put", `{"key":"a","value":{"x":1.50,"y":2}}`},
		{"run", "root/s0.t0", "notify", `{"key":"a","value":{"x":1.50,"y":2}}`},
		{"run", "root/s0.t0", "kv_put", `{"key":"a","value":{"x":1.5,"y":2}}`},
	} {
		k, err := idempotency.DeriveKey(other[0], other[1], other[2], []byte(other[3]))
		if err != nil || k == a {
			t.Errorf("%v: key %s (same as the original: %v), %v", other, k, k == a, err)
		}
	}
	if _, err := idempotency.DeriveKey("r", "n", "t", []byte(`{"a":`)); err == nil {
		t.Error("bad JSON accepted")
	}
	if _, err := idempotency.New(idempotency.Config{}); err == nil {
		t.Error("New without a store accepted")
	}
}

// An irreversible effect (RequireLive) whose call is cancelled after its function returned
// is not applied: the record is released, and the next attempt runs it.
func TestRequireLiveCancelledBeforeCommit(t *testing.T) {
	backends(t, func(t *testing.T, s store.Store) {
		e := executor(t, s, "o", 30*time.Second)
		ctx, cancel := context.WithCancel(ctxT(t))
		_, _, err := e.Do(ctx, idempotency.Call{Tenant: "t1", Key: "late"}, func(context.Context) (idempotency.Result, error) {
			cancel() // the caller goes away between the function's last check and the commit
			return idempotency.Result{Value: []byte("sent"), RequireLive: true,
				Effects: []store.Effect{store.Notify{Channel: "late", Payload: []byte("x")}}}, nil
		})
		if status.Code(err) != codes.Canceled {
			t.Fatalf("cancelled before the commit: %v", err)
		}
		if out, _ := s.ListOutbox(context.Background(), "t1", 0, 0); len(out) != 0 {
			t.Fatalf("the irreversible effect was applied: %+v", out)
		}
		_, o, err := e.Do(ctxT(t), idempotency.Call{Tenant: "t1", Key: "late"}, func(context.Context) (idempotency.Result, error) {
			return idempotency.Result{Value: []byte("sent")}, nil
		})
		if err != nil || o != idempotency.Executed {
			t.Fatalf("next attempt: %v %v", o, err)
		}
	})
}

// outage is a store whose BeginTool fails as PostgreSQL's does while it restarts, for
// its first `down` calls.
type outage struct {
	store.Store
	down  int64
	tries atomic.Int64
}

func (o *outage) BeginTool(ctx context.Context, b store.ToolBegin) (store.Begin, error) {
	if o.tries.Add(1) <= o.down {
		return store.Begin{}, fmt.Errorf("%w: dial tcp 127.0.0.1:5432: connect: connection refused", store.ErrUnavailable)
	}
	return o.Store.BeginTool(ctx, b)
}

// While the store is unavailable a call waits for it before claiming, then runs once;
// a call whose context ends meanwhile ends with it, having run nothing.
func TestWaitsForAnUnavailableStore(t *testing.T) {
	st := &outage{Store: storetest.OpenMemory(t), down: 4}
	e := executor(t, st, "a", time.Second)
	ran := 0
	v, o, err := e.Do(ctxT(t), idempotency.Call{Tenant: "t", Key: "k"}, func(context.Context) (idempotency.Result, error) {
		ran++
		return idempotency.Result{Value: []byte("v")}, nil
	})
	if err != nil || o != idempotency.Executed || string(v) != "v" || ran != 1 {
		t.Fatalf("Do = %q %v %v, ran %d: want the call run once after the outage", v, o, err, ran)
	}
	if n := st.tries.Load(); n != 5 {
		t.Errorf("BeginTool tried %d times, want 5 (4 refused)", n)
	}

	st = &outage{Store: storetest.OpenMemory(t), down: 1 << 40}
	e = executor(t, st, "a", time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, _, err = e.Do(ctx, idempotency.Call{Tenant: "t", Key: "k"}, func(context.Context) (idempotency.Result, error) {
		t.Error("ran while the store was down")
		return idempotency.Result{}, nil
	})
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Do = %v, want DEADLINE_EXCEEDED: the call's deadline passed while it waited", err)
	}
	if n := st.tries.Load(); n < 2 {
		t.Errorf("BeginTool tried %d times, want it tried again while waiting", n)
	}
}
