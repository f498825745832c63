package orchestrator

import (
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// endings names each way a run ends other than failing, in the three vocabularies that
// speak of it: the root node's status, the API's and the store's. A status not listed is
// a failure in all three.
var endings = []struct {
	node  meshv1.NodeStatus
	api   orchestratorv1.RunStatus
	store store.RunStatus
}{
	{meshv1.NodeStatus_NODE_STATUS_SUCCEEDED, orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED, store.StatusSucceeded},
	{meshv1.NodeStatus_NODE_STATUS_CANCELLED, orchestratorv1.RunStatus_RUN_STATUS_CANCELLED, store.StatusCancelled},
	{meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED, orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED, store.StatusDeadlineExceeded},
}

// runStatus is the API status of a run whose root node has status s; a root still
// running is a run still running.
func runStatus(s meshv1.NodeStatus) orchestratorv1.RunStatus {
	if s == meshv1.NodeStatus_NODE_STATUS_RUNNING {
		return orchestratorv1.RunStatus_RUN_STATUS_RUNNING
	}
	for _, e := range endings {
		if e.node == s {
			return e.api
		}
	}
	return orchestratorv1.RunStatus_RUN_STATUS_FAILED
}

// storeStatusOf is the store status a run's result is recorded with; it is always
// terminal, so a run recorded while still running is recorded as failed.
func storeStatusOf(st orchestratorv1.RunStatus) store.RunStatus {
	for _, e := range endings {
		if e.api == st {
			return e.store
		}
	}
	return store.StatusFailed
}

// apiStatusOf is the API status of a stored run; pending and running rows are running.
func apiStatusOf(st store.RunStatus) orchestratorv1.RunStatus {
	if st == store.StatusPending || st == store.StatusRunning {
		return orchestratorv1.RunStatus_RUN_STATUS_RUNNING
	}
	for _, e := range endings {
		if e.store == st {
			return e.api
		}
	}
	return orchestratorv1.RunStatus_RUN_STATUS_FAILED
}
