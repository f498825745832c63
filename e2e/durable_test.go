package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

// openMeshStore opens the shared mesh's durable store (the SQLite file `curfew up` gave
// toolrunner in its data directory) beside the running services.
func openMeshStore(t *testing.T) store.Store {
	t.Helper()
	s, err := store.Open(context.Background(), filepath.Join(mesh.Dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// outboxFor returns the default tenant's outbox rows on channel.
func outboxFor(t *testing.T, s store.Store, channel string) []store.OutboxEntry {
	t.Helper()
	var out []store.OutboxEntry
	var after int64
	for {
		page, err := s.ListOutbox(context.Background(), md.DefaultTenant, after, 1000)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range page {
			if e.Channel == channel {
				out = append(out, e)
			}
			after = e.ID
		}
		if len(page) < 1000 {
			return out
		}
	}
}

// kv_put and notify through a run take effect once each, in the durable store; the same
// call repeated (a retry, or a duplicate) replays its result and adds no effect.
func TestDurableToolsTakeEffectOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := openMeshStore(t)
	channel := fmt.Sprintf("e2e-%d", time.Now().UnixNano())
	kvKey := "release-" + channel
	plan := fmt.Sprintf(`{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 3, "tools": [
	    {"name": "kv_put", "args": {"key": %q, "value": {"version": 7}}},
	    {"name": "notify", "args": {"channel": %q, "message": "released"}}]},
	  {"answer_tokens": 3}]}`, kvKey, channel)
	res, _ := runPlan(ctx, client(t), plan, 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v %s", res.err, dump(res.finished))
	}
	kv, err := s.GetKV(ctx, md.DefaultTenant, kvKey)
	if err != nil || string(kv.Value) != `{"version": 7}` || kv.Version != 1 {
		t.Fatalf("kv %q: %+v %v", kvKey, kv, err)
	}
	if rows := outboxFor(t, s, channel); len(rows) != 1 || string(rows[0].Payload) != "released" {
		t.Fatalf("outbox %s: %+v", channel, rows)
	}

	// The same notify call again, as a retry would send it (same run, node and
	// arguments, no key of its own): replayed, no second row.
	conn, err := mesh.ConnAs(meshtls.Orchestrator, "toolrunner") // as a caller of Execute
	if err != nil {
		t.Fatal(err)
	}
	tr := toolrunnerv1.NewToolRunnerServiceClient(conn)
	call := func(run, node, args string) error {
		cctx := metadata.AppendToOutgoingContext(ctx, md.RunID, run, md.NodeID, node)
		st, err := tr.Execute(cctx, &toolrunnerv1.ExecuteRequest{Name: "notify", ArgsJson: args})
		if err != nil {
			return err
		}
		for {
			r, err := st.Recv()
			if err != nil {
				return err
			}
			if r.GetResult() != nil {
				return nil
			}
		}
	}
	args := fmt.Sprintf(`{"channel": %q, "message": "direct"}`, channel)
	for i := range 3 {
		if err := call("e2e-durable-"+channel, "root/s0.t0", args); err != nil {
			t.Fatalf("direct notify %d: %v", i, err)
		}
	}
	if rows := outboxFor(t, s, channel); len(rows) != 2 {
		t.Fatalf("outbox %s after one run and 3 identical direct calls: %d rows, want 2", channel, len(rows))
	}

	// notify never fires with less time left than its grace.
	short, stop := context.WithTimeout(ctx, 300*time.Millisecond)
	defer stop()
	st, err := tr.Execute(metadata.AppendToOutgoingContext(short, md.RunID, "e2e-durable-grace-"+channel, md.NodeID, "root/s0.t0"),
		&toolrunnerv1.ExecuteRequest{Name: "notify", ArgsJson: fmt.Sprintf(`{"channel": %q, "grace_ms": 2000}`, channel)})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "grace") {
		t.Fatalf("notify inside its grace: %v", err)
	}
	if rows := outboxFor(t, s, channel); len(rows) != 2 {
		t.Fatalf("a notify inside its grace fired: %d rows", len(rows))
	}
}

// A run cancelled before its notify step never sends the notification.
func TestNotifyNeverFiresAfterCancel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := openMeshStore(t)
	channel := fmt.Sprintf("e2e-cancel-%d", time.Now().UnixNano())
	plan := fmt.Sprintf(`{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 3, "tools": [{"name": "sleep", "args": {"ms": 1500}}]},
	  {"think_tokens": 3, "tools": [{"name": "notify", "args": {"channel": %q, "message": "too late"}}]},
	  {"answer_tokens": 3}]}`, channel)
	res, _ := runPlan(ctx, client(t), plan, 20*time.Second, 500*time.Millisecond, false)
	if status.Code(res.err) != codes.Canceled {
		t.Fatalf("run: %v", res.err)
	}
	time.Sleep(2 * time.Second) // past when the notify step would have run
	if rows := outboxFor(t, s, channel); len(rows) != 0 {
		t.Fatalf("notify fired after the run was cancelled: %+v", rows)
	}
}
