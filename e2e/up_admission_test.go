package e2e

import (
	"context"
	"testing"
	"time"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

// curfew up on its own store (DIR/curfew.db) has one orchestrator, which admits runs
// without claiming cluster-wide slots in the store: there is no replica to share its
// caps with (docs/cluster.md, "Cluster-wide admission"). Its status says so.
func TestUpAdmitsWithoutClusterSlots(t *testing.T) {
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
}
