package orchestrator

import (
	"testing"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// TestStatusMappings pins every value of the three status enums to the one it maps to.
func TestStatusMappings(t *testing.T) {
	pins(t, "runStatus", runStatus, map[meshv1.NodeStatus]orchestratorv1.RunStatus{
		meshv1.NodeStatus_NODE_STATUS_UNSPECIFIED:       orchestratorv1.RunStatus_RUN_STATUS_FAILED,
		meshv1.NodeStatus_NODE_STATUS_RUNNING:           orchestratorv1.RunStatus_RUN_STATUS_RUNNING,
		meshv1.NodeStatus_NODE_STATUS_SUCCEEDED:         orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED,
		meshv1.NodeStatus_NODE_STATUS_FAILED:            orchestratorv1.RunStatus_RUN_STATUS_FAILED,
		meshv1.NodeStatus_NODE_STATUS_CANCELLED:         orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED: orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED,
	})
	pins(t, "storeStatusOf", storeStatusOf, map[orchestratorv1.RunStatus]store.RunStatus{
		orchestratorv1.RunStatus_RUN_STATUS_UNSPECIFIED:       store.StatusFailed,
		orchestratorv1.RunStatus_RUN_STATUS_RUNNING:           store.StatusFailed,
		orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:         store.StatusSucceeded,
		orchestratorv1.RunStatus_RUN_STATUS_FAILED:            store.StatusFailed,
		orchestratorv1.RunStatus_RUN_STATUS_CANCELLED:         store.StatusCancelled,
		orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED: store.StatusDeadlineExceeded,
	})
	pins(t, "apiStatusOf", apiStatusOf, map[store.RunStatus]orchestratorv1.RunStatus{
		store.StatusPending:          orchestratorv1.RunStatus_RUN_STATUS_RUNNING,
		store.StatusRunning:          orchestratorv1.RunStatus_RUN_STATUS_RUNNING,
		store.StatusSucceeded:        orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED,
		store.StatusFailed:           orchestratorv1.RunStatus_RUN_STATUS_FAILED,
		store.StatusCancelled:        orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		store.StatusDeadlineExceeded: orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED,
		"unknown":                    orchestratorv1.RunStatus_RUN_STATUS_FAILED,
	})
}

// pins checks that f maps each key of want to its value.
func pins[K, V comparable](t *testing.T, name string, f func(K) V, want map[K]V) {
	t.Helper()
	for k, v := range want {
		if got := f(k); got != v {
			t.Errorf("%s(%v) = %v, want %v", name, k, got, v)
		}
	}
}
