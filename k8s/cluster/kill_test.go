package cluster_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"

	"github.com/curfew-mesh/curfew/k8s/cluster"
)

// testForcedDeletion deletes one pod of each service with --grace-period=0 --force while
// runs are in flight: no drain, no handover. The durable-state rules (docs/store.md,
// docs/leases.md) say a run owned by the killed orchestrator is taken over by the other
// one once its lease lapses and resumed from its last checkpoint; every run ends in a
// terminal state; no side effect happens twice. And every run succeeds: a call cut by
// its callee's death (a subagent's stream, a model's tokens, a sleep) is started over on
// a surviving replica (docs/retries.md).
func testForcedDeletion(ctx context.Context, t *testing.T, c *cluster.Cluster, tlsDir string) {
	const n = 20
	results := startLoad(ctx, t, dialClusterIP(ctx, t, c, tlsDir, 10), n, "killed-")
	time.Sleep(3 * time.Second)

	var killed []string
	for _, svc := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
		pods, err := c.Client.CoreV1().Pods("curfew").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + svc})
		if err != nil || len(pods.Items) == 0 {
			t.Fatalf("pods of %s: %v (%d)", svc, err, len(pods.Items))
		}
		name := pods.Items[0].Name
		if _, err := c.Kubectl(ctx, "-n", "curfew", "delete", "pod", name, "--grace-period=0", "--force"); err != nil {
			t.Fatal(err)
		}
		killed = append(killed, name)
	}
	t.Logf("deleted with --force: %s", strings.Join(killed, ", "))

	outcomes := map[string]int{}
	resumed := 0
	var lost, failed []string
	for range n {
		r := <-results
		if r.err != nil {
			lost = append(lost, r.err.Error())
			continue
		}
		outcomes[r.run.GetStatus().String()]++
		if r.run.GetEpoch() > 1 {
			resumed++
		}
		switch r.run.GetStatus() {
		case orchestratorv1.RunStatus_RUN_STATUS_RUNNING:
			lost = append(lost, fmt.Sprintf("run %s: still running", r.id))
		case orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:
		default:
			failed = append(failed, fmt.Sprintf("%s %s: %.160s", r.run.GetStatus(), r.run.GetErrorCode(), r.run.GetErrorMessage()))
		}
	}
	if len(lost) > 0 {
		t.Errorf("%d of %d runs have no terminal state:\n%s", len(lost), n, strings.Join(lost, "\n"))
	}
	if resumed == 0 {
		t.Errorf("no run was resumed by the surviving orchestrator (epoch > 1), want the killed one's runs")
	}
	versions := kvVersions(ctx, t, c, "killed-")
	for key, v := range versions {
		if v != 1 {
			t.Errorf("kv %s: %d writes took effect, want 1", key, v)
		}
	}
	t.Logf("%d runs: %v; %d resumed by another orchestrator; %d kv keys, each written once", n, outcomes, resumed, len(versions))
	if len(failed) > 0 {
		t.Errorf("%d of %d runs did not succeed after the forced deletions:\n%s", len(failed), n, strings.Join(failed, "\n"))
	}
	waitRollout(ctx, t, c, "curfew", 4*time.Minute)
}
