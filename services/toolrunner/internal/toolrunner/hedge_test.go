package toolrunner

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// A hedged call's backup (curfew-hedge: 1) with its twin's retry-id and idempotency key
// runs beside the twin: the retry-id table does not supersede the twin, and the key's
// record does not make the backup join it (which would make it wait for the very call
// it hedges).
func TestHedgeRunsBesideItsKeyedTwin(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	const run, node = "r-hedge", "root/s0.t0"
	ctx, cancel := context.WithTimeout(withKey(ident(run, node), "read-1"), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, md.RetryID, "twin-rid")

	first := make(chan result, 1)
	go func() {
		st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms": 3000}`})
		if err != nil {
			first <- result{err: err}
			return
		}
		first <- drain(st)
	}()
	waitRunning(t, e.srv.Nodes, run, node)

	backup := metadata.AppendToOutgoingContext(md.WithNode(ctx, node+"/hedge"), md.Hedge, md.HedgeBackup)
	start := time.Now()
	r := execute(backup, t, e.tools, "sleep", `{"ms": 20}`)
	if r.err != nil {
		t.Fatalf("backup: %v", r.err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("backup answered after %v: it joined its twin instead of running", d)
	}
	// The twin still runs: neither superseded nor joined.
	ns, _ := e.srv.Nodes.List(context.Background(), run, []string{node}, 0)
	for _, n := range ns {
		if n.GetId() == node && n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
			t.Fatalf("the twin %v after its backup answered, want it running", n)
		}
	}
	cancel()
	<-first
}
