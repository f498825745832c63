package toolrunner

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

func storeEnv(t *testing.T) (*env, store.Store) {
	t.Helper()
	s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return newEnv(t, mesh.ServerConfig{}, Config{Store: s, Owner: "test-owner"}), s
}

// kv_put writes once per call: repeating it (the derived key) replays; another key writes.
func TestKVPutOncePerKey(t *testing.T) {
	e, s := storeEnv(t)
	args := `{"key": "color", "value": "blue"}`
	for i := range 3 {
		r := execute(ident("r-kv", "root/s0.t0"), t, e.tools, "kv_put", args)
		if r.err != nil || r.out != `{"key":"color","written":true}` {
			t.Fatalf("call %d: %v %q", i, r.err, r.out)
		}
	}
	kv, err := s.GetKV(context.Background(), md.DefaultTenant, "color")
	if err != nil || string(kv.Value) != `"blue"` || kv.Version != 1 {
		t.Fatalf("kv %+v %v", kv, err)
	}
	// The caller's own key: a new effect (version 2), then replays.
	ctx := metadata.AppendToOutgoingContext(ident("r-kv", "root/s1.t0"), md.IdempotencyKey, "caller-key")
	for range 2 {
		if r := execute(ctx, t, e.tools, "kv_put", `{"key": "color", "value": "green"}`); r.err != nil {
			t.Fatal(r.err)
		}
	}
	if kv, _ := s.GetKV(context.Background(), md.DefaultTenant, "color"); kv.Version != 2 || string(kv.Value) != `"green"` {
		t.Fatalf("kv after a second key: %+v", kv)
	}
	if v := testutil.ToFloat64(e.srv.effects.WithLabelValues("kv_put")); v != 2 {
		t.Fatalf("curfew_tool_effects_total{tool=kv_put} = %v, want 2", v)
	}
}

// A cancelled notify sends nothing, and without a store the durable tools refuse.
func TestNotifyCancelledAndNoStore(t *testing.T) {
	e, s := storeEnv(t)
	ctx, cancel := context.WithCancel(ident("r-n", "root/s0.t0"))
	cancel()
	r := execute(ctx, t, e.tools, "notify", `{"channel": "ops", "message": "x"}`)
	meshtest.WantCode(t, r.err, codes.Canceled)
	if rows, _ := s.ListOutbox(context.Background(), md.DefaultTenant, 0, 0); len(rows) != 0 {
		t.Fatalf("a cancelled notify fired: %+v", rows)
	}
	plain := newEnv(t, mesh.ServerConfig{}, Config{})
	r = execute(ident("r-n", "root/s0.t1"), t, plain.tools, "kv_put", `{"key": "a", "value": 1}`)
	meshtest.WantCode(t, r.err, codes.FailedPrecondition, "--store")
	r = execute(ident("r-n", "root/s0.t2"), t, plain.tools, "kv_put", `{"key": "a"}`)
	meshtest.WantCode(t, r.err, codes.InvalidArgument, "args.value")
}

// The durable tools' effect counters are exported (at 0) with a shared store only: a
// private store shows the series that no store showed.
func TestEffectSeriesFollowTheStore(t *testing.T) {
	s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	for _, c := range []struct {
		name  string
		store Store
		want  int
	}{{"private", nil, 1}, {"shared", s, 3}} {
		reg := prometheus.NewRegistry()
		newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg, Store: c.store})
		if n, err := testutil.GatherAndCount(reg, "curfew_tool_effects_total"); err != nil || n != c.want {
			t.Errorf("%s store: %d curfew_tool_effects_total series (%v), want %d", c.name, n, err, c.want)
		}
	}
}
