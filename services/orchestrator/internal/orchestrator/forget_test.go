package orchestrator

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// startEnded starts a run with an idempotency key and waits for it to end.
func (e *env) startEnded(t *testing.T, key string) *orchestratorv1.Run {
	t.Helper()
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{
		Task: tinyPlan, IdempotencyKey: key, Timeout: durationpb.New(10 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	return e.waitEnded(t, res.GetRun().GetRunId())
}

// On a process-private store the oldest ended run beyond MaxRuns leaves the store with
// the table, as a bare orchestrator forgot it before it had a store: GetRun is
// NOT_FOUND, ListRuns does not list it, and its idempotency key starts a new run.
func TestPrivateStoreForgetsBeyondMaxRuns(t *testing.T) {
	ctx := context.Background()
	st := privateStore(t)
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) { c.MaxRuns, c.Store = 2, st })
	first := e.startEnded(t, "k1").GetRunId()
	e.startEnded(t, "k2")
	e.startEnded(t, "k3")

	until := time.Now().Add(5 * time.Second) // deleted off the caller's path
	for {
		_, err := st.GetRun(ctx, md.DefaultTenant, first)
		if errors.Is(err, store.ErrNotFound) {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the forgotten run is still in the private store after 5s: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: first})
	meshtest.WantCode(t, err, codes.NotFound)
	list, err := e.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetRuns()) != 2 {
		t.Errorf("ListRuns lists %d runs, want the 2 kept", len(list.GetRuns()))
	}
	for _, r := range list.GetRuns() {
		if r.GetRunId() == first {
			t.Errorf("ListRuns lists the forgotten run %s", first)
		}
	}
	if again := e.startEnded(t, "k1").GetRunId(); again == first {
		t.Errorf("the forgotten run's key started run %s again, want a new run", first)
	}
}

// On a shared store a run forgotten beyond MaxRuns stays in the store, where other
// orchestrators read it, and is served from there.
func TestSharedStoreKeepsForgottenRuns(t *testing.T) {
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) { c.MaxRuns, c.Store = 2, openStore(t) })
	first := e.startEnded(t, "k1").GetRunId()
	e.startEnded(t, "k2")
	e.startEnded(t, "k3")
	if _, err := e.srv.get(first); err == nil {
		t.Fatalf("run %s is still in the table, want it forgotten beyond MaxRuns 2", first)
	}
	e.srv.mu.Lock()
	drops, dropping := len(e.srv.drops), e.srv.dropping
	e.srv.mu.Unlock()
	if drops != 0 || dropping {
		t.Fatalf("%d runs queued for deletion (dropping %v) from a shared store, want none", drops, dropping)
	}
	r, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: first})
	if err != nil || r.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("GetRun of the forgotten run: %v, %v; want it from the store, succeeded", r.GetRun().GetStatus(), err)
	}
	if again := e.startEnded(t, "k1").GetRunId(); again != first {
		t.Errorf("the key of a run in a shared store started run %s, want %s", again, first)
	}
}
