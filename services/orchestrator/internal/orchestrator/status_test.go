package orchestrator

import (
	"testing"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// TestStatusMappings pins every value of the three status enums to the one it maps to.
func TestStatusMappings(t *testing.T) {
	const (
		running  = orchestratorv1.RunStatus_RUN_STATUS_RUNNING
		ok       = orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
		failed   = orchestratorv1.RunStatus_RUN_STATUS_FAILED
		canceled = orchestratorv1.RunStatus_RUN_STATUS_CANCELLED
		deadline = orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED
	)
	for node, want := range map[meshv1.NodeStatus]orchestratorv1.RunStatus{
		meshv1.NodeStatus_NODE_STATUS_UNSPECIFIED:       failed,
		meshv1.NodeStatus_NODE_STATUS_RUNNING:           running,
		meshv1.NodeStatus_NODE_STATUS_SUCCEEDED:         ok,
		meshv1.NodeStatus_NODE_STATUS_FAILED:            failed,
		meshv1.NodeStatus_NODE_STATUS_CANCELLED:         canceled,
		meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED: deadline,
	} {
		if got := runStatus(node); got != want {
			t.Errorf("runStatus(%v) = %v, want %v", node, got, want)
		}
	}
	for api, want := range map[orchestratorv1.RunStatus]store.RunStatus{
		orchestratorv1.RunStatus_RUN_STATUS_UNSPECIFIED: store.StatusFailed,
		running:  store.StatusFailed,
		ok:       store.StatusSucceeded,
		failed:   store.StatusFailed,
		canceled: store.StatusCancelled,
		deadline: store.StatusDeadlineExceeded,
	} {
		if got := storeStatusOf(api); got != want {
			t.Errorf("storeStatusOf(%v) = %v, want %v", api, got, want)
		}
	}
	for st, want := range map[store.RunStatus]orchestratorv1.RunStatus{
		store.StatusPending:          running,
		store.StatusRunning:          running,
		store.StatusSucceeded:        ok,
		store.StatusFailed:           failed,
		store.StatusCancelled:        canceled,
		store.StatusDeadlineExceeded: deadline,
		"unknown":                    failed,
	} {
		if got := apiStatusOf(st); got != want {
			t.Errorf("apiStatusOf(%q) = %v, want %v", st, got, want)
		}
	}
}
