package e2e

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
)

// loadResult is one run of a load loop.
type loadResult struct {
	start, end time.Time
	ok         bool
}

// Issue 24's store outage: a private PostgreSQL under two orchestrators (and one of
// every other service) is stopped for 10 s mid-load. A run started while it is down
// waits for it within its deadline and succeeds: its caller's API key, verified a
// moment before, still holds, and the run is recorded once the store is back. The
// orchestrators say cluster-wide admission is degraded and still
// answer status; once it is back, coordination resumes: runs succeed again, the paid cap
// of 2 holds across both replicas, status is coordinated again, and no slot stays held
// once the load ends.
// No spend is lost to the outage: the durable ledger ends up with every token modelproxy
// counted, those its decoders emitted while the store was down included.
func TestClusterCoordinationSurvivesStoreOutage(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pg := startPrivatePG(t)
	oc := newOpsBaseOn(ctx, t, "cluster-outage", pg.dsn())
	c := oc.Cluster
	dep, depAddr := startCapDependency(t)
	toolsFile := filepath.Join(c.Dir, "tools.json")
	writeFile(t, toolsFile, `{"sources": [{"name": "dep", "kind": "grpc", "address": "`+depAddr+`", "trusted": true}]}`)
	model, sub, tools, err := c.Mesh(ctx, map[string][]string{"toolrunner": {"--tools-config", toolsFile}})
	if err != nil {
		t.Fatal(err)
	}
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, `{"pools": [{"name": "paid", "max_in_flight": 2, "max_queue": 512, "max_queue_age": "1m"},
	  {"name": "overflow", "max_in_flight": 8, "overflow": true}]}`)
	for _, n := range []string{"orchestrator-a", "orchestrator-b"} {
		oc.addOrchestrator(ctx, t, n, c.OrchestratorArgs(model, sub, tools, "--admission-config", adm,
			"--cluster-slot-ttl", "2s", "--cluster-replicas", "2")...)
	}
	const work = `{"tokens_per_second": 1000, "steps": [{"tools": [{"name": "dep__work", "args": {}}]}, {"answer_tokens": 1}]}`
	waitFor(t, "toolrunner lists dep__work", time.Minute, func() bool {
		fin, err := runOnce(ctx, oc.runs[0], &orchestratorv1.RunRequest{Task: work}, 30*time.Second)
		return err == nil && fin.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
	})

	// Six clients start runs in a loop, three on each orchestrator.
	var (
		mu      sync.Mutex
		results []loadResult
		stop    atomic.Bool
		wg      sync.WaitGroup
	)
	for i := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() && ctx.Err() == nil {
				r := loadResult{start: time.Now()}
				fin, err := runOnce(ctx, oc.runs[i%2], &orchestratorv1.RunRequest{Task: work}, 20*time.Second)
				r.end, r.ok = time.Now(), err == nil && fin.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				if !r.ok {
					time.Sleep(50 * time.Millisecond) // a refused client backs off a little
				}
			}
		}()
	}
	since := func(t0 time.Time) (ok, failed int, longest time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range results {
			if r.start.Before(t0) {
				continue
			}
			if r.ok {
				ok++
			} else {
				failed++
				longest = max(longest, r.end.Sub(r.start))
			}
		}
		return ok, failed, longest
	}
	dep.high.Store(0)
	before := time.Now()
	time.Sleep(3 * time.Second)
	if ok, _, _ := since(before); ok == 0 {
		t.Fatal("no run succeeded before the outage")
	}
	if h := dep.high.Load(); h > 2 {
		t.Fatalf("before the outage: %d paid runs in flight across two orchestrators, cap 2", h)
	}

	// Two long runs on orchestrator-a, decoding at a known rate, to be cancelled while the
	// store is down: one through orchestrator-a, one through orchestrator-b.
	const long = `{"tokens_per_second": 20, "steps": [{"answer_tokens": 4000}]}`
	type longRun struct {
		id, via       string
		client        orchestratorv1.OrchestratorServiceClient
		started, sent time.Time
		answered      time.Time
		err           error
	}
	longs := []*longRun{{via: "orchestrator-a", client: oc.runs[0]}, {via: "orchestrator-b", client: oc.runs[1]}}
	for _, l := range longs {
		r, err := oc.runs[0].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: long, Timeout: durationpb.New(2 * time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		l.id, l.started = r.GetRun().GetRunId(), time.Now()
	}
	// Longer than the orchestrators' peer refresh (2 s): orchestrator-b has read from the
	// store that orchestrator-a owns live runs.
	time.Sleep(3 * time.Second)

	pg.stop(t)
	down := time.Now()
	// Their tenant cancels them a second into the outage. On orchestrator-a the API key
	// verified a moment before still holds, and the cancel itself needs no store;
	// orchestrator-b cannot read the run's owner from the store, so it asks the peers it
	// last read there.
	var cancels sync.WaitGroup
	for _, l := range longs {
		cancels.Go(func() {
			time.Sleep(time.Second)
			cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
			defer ccancel()
			l.sent = time.Now()
			_, l.err = l.client.CancelRun(cctx, &orchestratorv1.CancelRunRequest{RunId: l.id, Reason: "e2e: cancelled during the store outage"})
			l.answered = time.Now()
		})
	}
	// The load's clients may all be inside runs that wait out the outage, so two more
	// clients start one run each, on each orchestrator, well inside it.
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-time.After(2 * time.Second):
			case <-ctx.Done():
				return
			}
			r := loadResult{start: time.Now()}
			fin, err := runOnce(ctx, oc.runs[i], &orchestratorv1.RunRequest{Task: work}, 20*time.Second)
			r.end, r.ok = time.Now(), err == nil && fin.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		}()
	}
	degraded := false
	for time.Since(down) < 10*time.Second {
		for _, o := range oc.orchs {
			body, err := httpGet("http://" + o.AdminAddr + "/metrics")
			if err != nil {
				t.Fatalf("%s /metrics while the store is down: %v", o.Name, err)
			}
			degraded = degraded || strings.Contains(body, "\ncurfew_admission_cluster_degraded 1\n")
		}
		time.Sleep(200 * time.Millisecond)
	}
	pg.start(t)
	up := time.Now()
	if !degraded {
		t.Error("status never said cluster admission was degraded while the store was down")
	}
	cancels.Wait()
	for _, l := range longs {
		t.Logf("CancelRun through %s sent %v into the outage: answered after %v (%v)", l.via, l.sent.Sub(down).Round(time.Millisecond),
			l.answered.Sub(l.sent).Round(time.Millisecond), l.err)
		if l.err != nil {
			t.Errorf("CancelRun through %s during the store outage: %v", l.via, l.err)
		}
	}

	// Coordination resumes.
	took := waitFor(t, "a run succeeds after the store is back", time.Minute, func() bool {
		ok, _, _ := since(time.Now().Add(-500 * time.Millisecond))
		return ok > 0
	})
	t.Logf("runs succeed again %v after the store is back", took.Round(time.Millisecond))
	time.Sleep(3 * time.Second) // slots of the outage's runs: released, or expired (TTL 2 s)
	dep.high.Store(0)
	after := time.Now()
	time.Sleep(5 * time.Second)
	okAfter, _, _ := since(after)
	if h := dep.high.Load(); h > 2 || okAfter == 0 {
		t.Errorf("after the outage: high-water mark %d (cap 2), %d runs succeeded", h, okAfter)
	}
	for i := range oc.admins {
		st, err := oc.admins[i].Status(ctx, &adminv1.StatusRequest{})
		if err != nil || st.GetCluster().GetDegraded() || !st.GetCluster().GetEnabled() {
			t.Errorf("orchestrator %d after the outage: %v %v, want coordinated", i, st.GetCluster(), err)
		}
		// The other coordinated limits are in status too: this orchestrator's retry
		// windows and breakers' probe leases, by target.
		rows := map[string]bool{}
		for _, c := range st.GetCoordination() {
			if c.GetService() == "orchestrator" && c.GetReplica() == st.GetReplica() {
				rows[c.GetPart()+" "+c.GetTarget()] = true
			}
		}
		for _, want := range []string{"retry_window modelproxy", "retry_window toolrunner", "breaker_probe toolrunner"} {
			if !rows[want] {
				t.Errorf("orchestrator %d's status lacks its coordination %q: %v", i, want, st.GetCoordination())
			}
		}
	}
	stop.Store(true)
	wg.Wait()

	// The runs started while the store was down (admitted on this replica's share, or
	// queued) waited for the store within their deadline and succeeded once it was back.
	var okDown, failedDown int
	var longest time.Duration
	mu.Lock()
	for _, r := range results {
		if r.start.Before(down.Add(time.Second)) || !r.start.Before(up) {
			continue
		}
		if r.ok {
			okDown++
			continue
		}
		failedDown++
		longest = max(longest, r.end.Sub(r.start))
	}
	mu.Unlock()
	t.Logf("store down for %v: of the runs started meanwhile, %d waited for it and succeeded, %d were refused, the longest refusal took %v",
		up.Sub(down).Round(time.Millisecond), okDown, failedDown, longest.Round(time.Millisecond))
	if okDown+failedDown == 0 {
		t.Error("no run started while the store was down")
	}
	if failedDown > 0 {
		t.Errorf("%d runs started while the store was down failed (the longest after %v), want every one to wait for the store and succeed",
			failedDown, longest.Round(time.Millisecond))
	}
	// The long runs ended cancelled, their decoders stopped at the cancel: no more tokens
	// than the rate allows up to the cancel's sending (and a second's margin), at most one
	// after it.
	for _, l := range longs {
		var lr *orchestratorv1.Run
		waitFor(t, "the run cancelled through "+l.via+" during the outage is recorded cancelled", 30*time.Second, func() bool {
			got, err := oc.runs[0].GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: l.id})
			lr = got.GetRun()
			return err == nil && lr.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_CANCELLED
		})
		bound := int64(20 * (l.sent.Sub(l.started) + time.Second).Seconds())
		t.Logf("the run cancelled through %s: %d tokens (bound %d), %d after its cancel", l.via, lr.GetTokens(), bound, lr.GetTokensAfterCancel())
		if lr.GetTokens() == 0 || lr.GetTokens() > bound || lr.GetTokensAfterCancel() > 1 {
			t.Errorf("the run cancelled through %s during the outage: %d tokens (want 1 to %d), %d after its cancel (want at most 1)",
				l.via, lr.GetTokens(), bound, lr.GetTokensAfterCancel())
		}
	}
	waitFor(t, "no paid slot held once the load ended", 10*time.Second, func() bool {
		slots, err := oc.st.ListSlots(ctx, admission.PoolScope("paid"))
		if err != nil {
			return false
		}
		for _, s := range slots {
			if s.Held(time.Now()) {
				return false
			}
		}
		return true
	})

	// The decoders that ran while the store was down kept their entries and appended them
	// once it was back: no gap between the ledger and modelproxy's own count.
	var ledger, emitted float64
	waitFor(t, "the ledger holds every token modelproxy emitted", 30*time.Second, func() bool {
		emitted = metricsPage(t, model).value("curfew_model_tokens_total", nil, false)
		ledger = ledgerTokens(ctx, t, pg.dsn())
		return emitted > 0 && ledger == emitted
	})
	t.Logf("the ledger holds %.0f tokens, modelproxy emitted %.0f", ledger, emitted)
}

// ledgerTokens sums the output and orphan tokens of every entry in the durable ledger at
// dsn (the prompt entries apart).
func ledgerTokens(ctx context.Context, t *testing.T, dsn string) float64 {
	t.Helper()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(ctx) }()
	var n int64
	if err := c.QueryRow(ctx, `SELECT COALESCE(SUM(tokens), 0) FROM token_ledger WHERE kind <> 'prompt'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return float64(n)
}
