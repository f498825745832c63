package e2e

import (
	"context"
	"testing"
	"time"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

// curfew up on its own store (DIR/curfew.db) has one replica of each service, so it
// coordinates nothing across replicas in the store: the orchestrator admits runs without
// claiming cluster-wide slots, and no service asks for retry windows or breaker probe
// leases (docs/cluster.md). Its status says so.
func TestUpCoordinatesNothingOnItsOwnStore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := mesh.Conn("orchestrator")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := adminv1.NewAdminServiceClient(conn).Status(ctx, &adminv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.GetCluster().GetEnabled() {
		t.Errorf("curfew up's orchestrator claims cluster-wide slots on its own store: %v", st.GetCluster())
	}
	// Nor retry windows or breaker probe leases: Status lists those of the orchestrator
	// and of every modelproxy replica.
	for _, c := range st.GetCoordination() {
		if c.GetPart() == "retry_window" || c.GetPart() == "breaker_probe" {
			t.Errorf("curfew up coordinates %s of %s %s on its own store: %v", c.GetPart(), c.GetService(), c.GetTarget(), c)
		}
	}
}
