package storetest

import (
	"errors"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

var replicaTests = map[string]func(*env){
	"PutListReplace": func(e *env) {
		loaded := e.clock.Now().Add(-time.Minute)
		a := store.ReplicaConfig{Service: "orchestrator", Replica: "pod-a", Config: "admission", Version: "aaaaaaaaaaaa", LoadedAt: loaded}
		b := store.ReplicaConfig{Service: "orchestrator", Replica: "pod-b", Config: "admission", Version: "aaaaaaaaaaaa", LoadedAt: loaded}
		m := store.ReplicaConfig{Service: "modelproxy", Replica: "pod-c", Config: "admission", Version: "cccccccccccc"}
		for _, c := range []store.ReplicaConfig{b, a, m} {
			if err := e.s.PutReplicaConfig(e.ctx, c); err != nil {
				e.t.Fatalf("put %+v: %v", c, err)
			}
		}
		// Another replica sees them, by service, config, replica.
		got, err := e.open().ListReplicaConfigs(e.ctx, "orchestrator")
		if err != nil || len(got) != 2 || got[0].Replica != "pod-a" || got[1].Replica != "pod-b" {
			e.t.Fatalf("list orchestrator: %+v, %v", got, err)
		}
		if g := got[0]; g.Version != a.Version || !g.LoadedAt.Equal(loaded) || !g.SeenAt.Equal(e.clock.Now()) ||
			g.LastError != "" || !g.LastErrorAt.IsZero() {
			e.t.Fatalf("row %+v", g)
		}
		all, err := e.s.ListReplicaConfigs(e.ctx, "")
		if err != nil || len(all) != 3 || all[0].Service != "modelproxy" {
			e.t.Fatalf("list all: %+v, %v", all, err)
		}
		// A failed reload replaces the row, keeping its version.
		e.clock.Advance(time.Second)
		a.LastError, a.LastErrorAt = "pools[0].max_in_flight 0: must be at least 1", e.clock.Now()
		if err := e.s.PutReplicaConfig(e.ctx, a); err != nil {
			e.t.Fatal(err)
		}
		got, _ = e.s.ListReplicaConfigs(e.ctx, "orchestrator")
		if g := got[0]; g.LastError != a.LastError || !g.LastErrorAt.Equal(a.LastErrorAt) || !g.SeenAt.Equal(e.clock.Now()) ||
			g.Version != a.Version {
			e.t.Fatalf("after a failed reload: %+v", g)
		}
		if g := got[1]; !g.SeenAt.Equal(e.clock.Now().Add(-time.Second)) {
			e.t.Fatalf("the other replica's row moved: %+v", g)
		}
	},
	"Prune": func(e *env) {
		if err := e.s.PutReplicaConfig(e.ctx, store.ReplicaConfig{Service: "toolrunner", Replica: "old", Config: "tools", Version: "v1"}); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(time.Hour)
		if err := e.s.PutReplicaConfig(e.ctx, store.ReplicaConfig{Service: "toolrunner", Replica: "new", Config: "tools", Version: "v2"}); err != nil {
			e.t.Fatal(err)
		}
		n, err := e.s.PruneReplicaConfigs(e.ctx, e.clock.Now().Add(-time.Minute))
		if err != nil || n != 1 {
			e.t.Fatalf("prune: %d, %v; want 1", n, err)
		}
		got, err := e.s.ListReplicaConfigs(e.ctx, "toolrunner")
		if err != nil || len(got) != 1 || got[0].Replica != "new" {
			e.t.Fatalf("after prune: %+v, %v", got, err)
		}
	},
	"Invalid": func(e *env) {
		for _, c := range []store.ReplicaConfig{{Replica: "r", Config: "c"}, {Service: "s", Config: "c"}, {Service: "s", Replica: "r"}} {
			if err := e.s.PutReplicaConfig(e.ctx, c); !errors.Is(err, store.ErrInvalidArgument) {
				e.t.Fatalf("put %+v: %v, want ErrInvalidArgument", c, err)
			}
		}
	},
}
