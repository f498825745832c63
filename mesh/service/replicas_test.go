package service_test

import (
	"testing"

	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// TestLiveReplicas counts the replicas of one service that wrote their rows, once each
// whatever their number of files, and always the caller itself.
func TestLiveReplicas(t *testing.T) {
	st := storetest.OpenMemory(t)
	ctx := t.Context()
	for _, r := range []store.ReplicaConfig{
		{Service: "orchestrator", Replica: "host/a", Config: "admission"},
		{Service: "orchestrator", Replica: "host/a", Config: "retry"},
		{Service: "orchestrator", Replica: "host/b", Config: "admission"},
		{Service: "modelproxy", Replica: "host/m", Config: "admission"},
	} {
		if err := st.PutReplicaConfig(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		self string
		want int
	}{{"host/a", 2}, {"host/c", 3}} {
		n, err := service.LiveReplicas(ctx, st, "orchestrator", tc.self)
		if err != nil || n != tc.want {
			t.Errorf("LiveReplicas as %s = %d, %v; want %d", tc.self, n, err, tc.want)
		}
	}
}
