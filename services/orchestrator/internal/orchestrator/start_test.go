package orchestrator

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// Run, StartRun and Replay pass the same gates in the same order: a bad task is refused
// before the drain is looked at, and the drain before the time left.
func TestOneStartPath(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	entries := map[string]func(ctx context.Context, task string) error{
		"Run": func(ctx context.Context, task string) error {
			st, err := e.orch.Run(ctx, &orchestratorv1.RunRequest{Task: task})
			if err != nil {
				return err
			}
			_, err = st.Recv()
			return err
		},
		"StartRun": func(ctx context.Context, task string) error {
			_, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: task})
			return err
		},
		"Replay": func(ctx context.Context, task string) error {
			payload, _ := json.Marshal(ReplayPayload{Task: task})
			_, _, err := e.srv.Replay(md.WithIdentity(ctx, md.Identity{Tenant: md.DefaultTenant}), "k", payload, 0)
			return err
		},
	}
	short := func() context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 80*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	for name, start := range entries {
		meshtest.WantCode(t, start(context.Background(), "not a plan"), codes.InvalidArgument, "JSON plan")
		err := start(short(), tinyPlan)
		if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start run") {
			t.Errorf("%s with 80ms left: %v, want DEADLINE_EXCEEDED no time left to start run", name, err)
		}
	}
	e.srv.Drain(time.Now().Add(10 * time.Second))
	for name, start := range entries {
		meshtest.WantCode(t, start(context.Background(), "not a plan"), codes.InvalidArgument, "JSON plan")
		err := start(short(), tinyPlan)
		if status.Code(err) != codes.Unavailable {
			t.Errorf("%s while draining: %v, want UNAVAILABLE (the drain is looked at before the time left)", name, err)
		}
		wantDraining(t, start(context.Background(), tinyPlan), "draining")
	}
}

// On a process-private store a run reports epoch 0, as without a durable store, and the
// run-lease metrics are not registered: the metric set of a bare orchestrator stays the
// same. On a shared store the run is at epoch 1 and the metrics are there.
func TestPrivateStoreHasNoLeases(t *testing.T) {
	for _, shared := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
			c.Registerer = reg
			if shared {
				c.Store = openStore(t)
			}
		})
		res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(10 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		r := e.waitEndedTenant(t, md.DefaultTenant, res.GetRun().GetRunId())
		want := int64(0)
		if shared {
			want = 1
		}
		if r.GetEpoch() != want || res.GetRun().GetEpoch() != want {
			t.Errorf("shared %v: run at epoch %d (started at %d), want %d", shared, r.GetEpoch(), res.GetRun().GetEpoch(), want)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, mf := range mfs {
			names = append(names, mf.GetName())
		}
		if got := strings.Contains(strings.Join(names, ","), "curfew_run_leases_held"); got != shared {
			t.Errorf("shared %v: metrics %v, want the lease metrics only on a shared store", shared, names)
		}
	}
}
