package cluster_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"

	"github.com/curfew-mesh/curfew/k8s/cluster"
)

// loadPlan is a run of about 75 s, longer than an orchestrator's drain bound (5 s + 20 s +
// 2 s), so that a rollout hands runs over: a tool call with a side effect (kv_put under
// the run's own key, whose version counts the writes that took effect), then five steps
// of a sleep each, the first with a subagent whose own sleep (25 s) outlasts the callees'
// shutdown grace (20 s), so that a drain cuts it mid-call and the call must start over on
// another replica (docs/retries.md), and every service has work in flight throughout.
func loadPlan(key string) string {
	sleep := `{"think_tokens": 40, "tools": [{"name": "sleep", "args": {"ms": 8000}}]}`
	return fmt.Sprintf(`{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 4, "tools": [
	    {"name": "kv_put", "args": {"key": %[1]q, "value": 1}},
	    {"name": "sleep", "args": {"ms": 8000}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": 40, "tools": [{"name": "sleep", "args": {"ms": 25000}}]},
	      {"answer_tokens": 5}]}}}]},
	  %[2]s, %[2]s, %[2]s, %[2]s,
	  {"answer_tokens": 5}]}`, key, sleep)
}

// podEnd is what the watch saw of a pod that was deleted: when it was asked to stop, its
// grace period, and how its container ended.
type podEnd struct {
	name     string
	deleted  time.Time
	grace    int64
	finished time.Time
	exitCode int32
	reason   string
}

// watchPodEnds records, until the test ends, how every pod of the namespace that is
// deleted ends. The kubelet reports the containers' terminated state before the pod object
// goes; an informer (not a bare watch, which the API server may end at any time) sees it.
func watchPodEnds(ctx context.Context, t *testing.T, c *cluster.Cluster, ns string) func() []podEnd {
	t.Helper()
	var mu sync.Mutex
	var ended []podEnd
	// The time each pod was asked to stop: its deletion timestamp less its grace period,
	// as first seen (the kubelet's final delete, with grace 0, moves both).
	requested := map[string]time.Time{}
	factory := informers.NewSharedInformerFactoryWithOptions(c.Client, 0, informers.WithNamespace(ns))
	inf := factory.Core().V1().Pods().Informer()
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			pod, ok := obj.(*corev1.Pod)
			if !ok || pod.DeletionTimestamp == nil || pod.DeletionGracePeriodSeconds == nil {
				return
			}
			mu.Lock()
			if _, seen := requested[pod.Name]; !seen {
				requested[pod.Name] = pod.DeletionTimestamp.Add(-time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second)
			}
			mu.Unlock()
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			pod, ok := obj.(*corev1.Pod)
			if !ok || pod.DeletionTimestamp == nil || pod.DeletionGracePeriodSeconds == nil {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			e := podEnd{name: pod.Name, deleted: requested[pod.Name]}
			if pod.Spec.TerminationGracePeriodSeconds != nil {
				e.grace = *pod.Spec.TerminationGracePeriodSeconds
			}
			for _, cs := range pod.Status.ContainerStatuses {
				if term := cs.State.Terminated; term != nil {
					e.finished, e.exitCode, e.reason = term.FinishedAt.Time, term.ExitCode, term.Reason
				}
			}
			ended = append(ended, e)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	factory.Start(stop)
	t.Cleanup(func() {
		close(stop)
		factory.Shutdown()
	})
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		t.Fatal("pod informer: no sync")
	}
	return func() []podEnd {
		mu.Lock()
		defer mu.Unlock()
		return append([]podEnd(nil), ended...)
	}
}

// waitOldPodsGone waits until no pod of the namespace is terminating: `kubectl rollout
// status` returns once the new pods are available, while the old ones may still drain.
func waitOldPodsGone(ctx context.Context, t *testing.T, c *cluster.Cluster, ns string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var terminating []string
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil {
				terminating = append(terminating, p.Name)
			}
		}
		if len(terminating) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pods still terminating after %s: %v", within, terminating)
		}
		time.Sleep(time.Second)
	}
}

// runResult is how one run of the load ended, as its client saw it.
type runResult struct {
	id       string
	attached bool
	run      *orchestratorv1.Run
	err      error
	moved    int // attached streams that ended UNAVAILABLE and were followed with WatchRun
}

// follow watches a run to its end with WatchRun, resuming on another replica when a
// watch ends UNAVAILABLE (a draining orchestrator), as docs/leases.md tells clients to.
func follow(ctx context.Context, api orchestratorv1.OrchestratorServiceClient, id string) (*orchestratorv1.Run, error) {
	var lastErr error
	for ctx.Err() == nil {
		stream, err := api.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
		if err == nil {
			for {
				ev, err := stream.Recv()
				if err != nil {
					lastErr = err
					break
				}
				if fin := ev.GetFinished(); fin != nil {
					return fin, nil
				}
			}
		} else {
			lastErr = err
		}
		if c := status.Code(lastErr); c != codes.Unavailable && c != codes.Canceled && c != codes.DeadlineExceeded {
			return nil, lastErr
		}
		time.Sleep(200 * time.Millisecond)
	}
	return nil, fmt.Errorf("run %s: %w (last: %w)", id, ctx.Err(), lastErr)
}

// startLoad starts n runs through api, half detached (StartRun) and half attached (Run),
// and returns once every run has its id; the results arrive on the channel as runs end.
func startLoad(ctx context.Context, t *testing.T, apis []orchestratorv1.OrchestratorServiceClient, n int, prefix string) <-chan runResult {
	t.Helper()
	results := make(chan runResult, n)
	var started sync.WaitGroup
	for i := range n {
		api := apis[i%len(apis)]
		key := prefix + strconv.Itoa(i)
		started.Add(1)
		if i%2 == 0 {
			go func() {
				res, err := api.StartRun(ctx, &orchestratorv1.StartRunRequest{
					Task: loadPlan(key), IdempotencyKey: key, Timeout: durationpb.New(5 * time.Minute),
				})
				started.Done()
				if err != nil {
					results <- runResult{err: fmt.Errorf("StartRun %s: %w", key, err)}
					return
				}
				id := res.GetRun().GetRunId()
				run, err := follow(ctx, api, id)
				results <- runResult{id: id, run: run, err: err}
			}()
			continue
		}
		go func() {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			defer cancel()
			r := runResult{attached: true}
			stream, err := api.Run(sctx, &orchestratorv1.RunRequest{Task: loadPlan(key)})
			if err != nil {
				started.Done()
				r.err = fmt.Errorf("Run %s: %w", key, err)
				results <- r
				return
			}
			once := sync.OnceFunc(started.Done)
			defer once()
			for {
				ev, err := stream.Recv()
				if err != nil {
					if r.id == "" || status.Code(err) != codes.Unavailable {
						r.err = fmt.Errorf("Run %s (%s): %w", key, r.id, err)
						break
					}
					// Handed over by a draining orchestrator: follow it elsewhere.
					r.moved++
					r.run, r.err = follow(sctx, api, r.id)
					break
				}
				if s := ev.GetStarted(); s != nil {
					r.id = s.GetRunId()
					once()
				}
				if fin := ev.GetFinished(); fin != nil {
					r.run = fin
					break
				}
			}
			results <- r
		}()
	}
	started.Wait()
	return results
}

// kvVersions returns the version of each kv key with the prefix, read from the dev
// overlay's PostgreSQL pod with its own psql.
func kvVersions(ctx context.Context, t *testing.T, c *cluster.Cluster, prefix string) map[string]int {
	t.Helper()
	out, err := c.Kubectl(ctx, "-n", "curfew", "exec", "curfew-postgres-0", "--",
		"psql", "-U", "curfew", "-d", "curfew", "-At", "-F", " ", "-c",
		"SELECT kv_key, version FROM kv WHERE kv_key LIKE '"+prefix+"%'")
	if err != nil {
		t.Fatal(err)
	}
	versions := map[string]int{}
	for line := range strings.Lines(string(out)) {
		key, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("psql: %q: %v", line, err)
		}
		versions[key] = n
	}
	return versions
}

// dialClusterIP makes n clients of the curfew-api Service's ClusterIP, which kube-proxy's
// rules make reachable from the node: a port-forward would pin one pod, which may go away.
// One connection per client, so that kube-proxy spreads them over the orchestrators.
func dialClusterIP(ctx context.Context, t *testing.T, c *cluster.Cluster, tlsDir string, n int) []orchestratorv1.OrchestratorServiceClient {
	t.Helper()
	ip, err := c.Kubectl(ctx, "-n", "curfew", "get", "svc", "curfew-api", "-o", "jsonpath={.spec.clusterIP}")
	if err != nil {
		t.Fatal(err)
	}
	var apis []orchestratorv1.OrchestratorServiceClient
	for range n {
		apis = append(apis, dialAPI(t, tlsDir, strings.TrimSpace(string(ip))+":7700"))
	}
	return apis
}

// testRollingUpdate rolls all four Deployments to a new image tag under 50 runs in flight.
func testRollingUpdate(ctx context.Context, t *testing.T, c *cluster.Cluster, tlsDir string) {
	apis := dialClusterIP(ctx, t, c, tlsDir, 10)
	newTag := "cluster-test-2"
	for ref := range services {
		if err := c.TagImage(ctx, ref+":"+testTag, ref+":"+newTag); err != nil {
			t.Fatal(err)
		}
	}
	ends := watchPodEnds(ctx, t, c, "curfew")

	const n = 50
	results := startLoad(ctx, t, apis, n, "rollout-")
	// Let every run get going (its first tools and the subagent) before the rollout.
	time.Sleep(3 * time.Second)
	rollStart := time.Now()
	for ref := range services {
		name := strings.TrimPrefix(ref[strings.LastIndex(ref, "/")+1:], "curfew-")
		if _, err := c.Kubectl(ctx, "-n", "curfew", "set", "image", "deployment/curfew-"+name, name+"="+ref+":"+newTag); err != nil {
			t.Fatal(err)
		}
	}
	waitRollout(ctx, t, c, "curfew", 8*time.Minute)
	waitOldPodsGone(ctx, t, c, "curfew", 2*time.Minute)
	t.Logf("rollout of 4 Deployments done in %s (old pods gone)", time.Since(rollStart).Round(time.Second))

	var lost []string
	attached, moved := 0, 0
	for range n {
		r := <-results
		switch {
		case r.err != nil:
			lost = append(lost, r.err.Error())
		case r.run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:
			lost = append(lost, fmt.Sprintf("run %s: %s %s: %s", r.id, r.run.GetStatus(), r.run.GetErrorCode(), r.run.GetErrorMessage()))
		}
		if r.attached {
			attached++
			moved += r.moved
		}
	}
	if len(lost) > 0 {
		t.Errorf("%d of %d runs did not succeed:\n%s", len(lost), n, strings.Join(lost, "\n"))
	}
	t.Logf("%d runs (%d attached, %d of them followed to another orchestrator) ended", n, attached, moved)

	versions := kvVersions(ctx, t, c, "rollout-")
	if len(versions) != n {
		t.Errorf("kv: %d keys rollout-*, want %d (one per run)", len(versions), n)
	}
	for key, v := range versions {
		if v != 1 {
			t.Errorf("kv %s: %d writes took effect, want 1", key, v)
		}
	}

	var stopped []string
	for _, e := range ends() {
		took := e.finished.Sub(e.deleted)
		stopped = append(stopped, fmt.Sprintf("%s %s exit %d", e.name, took.Round(100*time.Millisecond), e.exitCode))
		if e.finished.IsZero() || e.deleted.IsZero() {
			t.Errorf("pod %s: no deletion or terminated state seen (%v, %v)", e.name, e.deleted, e.finished)
			continue
		}
		// finishedAt has a 1 s resolution.
		if took > time.Duration(e.grace)*time.Second+time.Second || e.exitCode != 0 {
			t.Errorf("pod %s: stopped %s after its deletion with exit code %d (%s); want within its %d s grace period, exit 0 (drained, not killed)",
				e.name, took, e.exitCode, e.reason, e.grace)
		}
	}
	if len(stopped) < 8 {
		t.Errorf("%d pods were seen stopping, want the 8 old replicas", len(stopped))
	}
	t.Logf("pods stopped: %s", strings.Join(stopped, ", "))
}
