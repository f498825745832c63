package e2e

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// calleeKillPlan: a kv_put, a sleep and a spawn_subagent side by side, then a model step
// and a last sleep. The subagent's model step streams for 3 s and its sleep lasts 3 s, so
// that at the kill (1.5 s in) every kind of call is in flight: model streams (the
// subagent's), a subagent streaming its nodes through toolrunner, and a plain tool call.
func calleeKillPlan(key string) string {
	return fmt.Sprintf(`{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 2, "tools": [
	    {"name": "kv_put", "args": {"key": %[1]q, "value": 1}},
	    {"name": "sleep", "args": {"ms": 3000}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": 120, "tools": [{"name": "sleep", "args": {"ms": 3000}}]},
	      {"answer_tokens": 3}]}}}]},
	  {"think_tokens": 40, "tools": [{"name": "sleep", "args": {"ms": 1000}}]},
	  {"answer_tokens": 3}]}`, key)
}

// TestCalleesKilledMidCall: two replicas of each executor behind one name (a DNS server
// answering both loopback addresses, as a headless Service's name does), two
// orchestrators on one PostgreSQL store (so retries are coordinated by windows). One
// replica of each executor is killed with SIGKILL while every run has calls in flight on
// it. Every run succeeds on the survivors: a call cut mid-stream (a subagent's nodes, a
// model's tokens) is started over on the other replica, a retry refused by the window
// waits for it, and each kv_put took effect once.
func TestCalleesKilledMidCall(t *testing.T) {
	const runs = 10
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := storetest.PostgresDSN(t)
	c := newCluster(ctx, t, "calleekill", dsn)

	ips := []string{"127.0.0.1", "127.0.0.2"}
	targets := map[string]string{}
	ports := map[string]string{}
	for _, svc := range []string{"modelproxy", "toolrunner", "subagent"} {
		name := svc + ".curfew.test"
		ports[svc] = strconv.Itoa(freePort(t))
		targets[svc] = "dns://" + serveDNS(t, name, ips...) + "/" + name + ":" + ports[svc]
	}
	args := map[string][]string{
		"modelproxy": {"--store", dsn},
		"toolrunner": {"--store", dsn, "--subagent", targets["subagent"]},
		"subagent":   {"--modelproxy", targets["modelproxy"], "--toolrunner", targets["toolrunner"]},
	}
	replicas := map[string][]*meshproc.Proc{}
	for _, svc := range []string{"modelproxy", "toolrunner", "subagent"} {
		for i, ip := range ips {
			p, err := c.AddAt(ctx, svc, fmt.Sprintf("%s-%c", svc, 'a'+i), net.JoinHostPort(ip, ports[svc]), args[svc]...)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Start(ctx); err != nil {
				t.Fatalf("%s: %v", p.Name, err)
			}
			replicas[svc] = append(replicas[svc], p)
		}
	}
	var orchs []orchestratorv1.OrchestratorServiceClient
	for _, name := range []string{"orchestrator-a", "orchestrator-b"} {
		p, err := c.Add(ctx, "orchestrator", name, "--store", dsn, "--modelproxy", targets["modelproxy"],
			"--toolrunner", targets["toolrunner"], "--subagent", targets["subagent"])
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		orchs = append(orchs, orchestratorv1.NewOrchestratorServiceClient(conn))
	}
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })

	// A first round of runs connects every caller to both replicas of each callee
	// (round_robin sends calls only to the replicas it is connected to).
	tag := fmt.Sprintf("calleekill-%d", time.Now().UnixNano())
	start := func(prefix string, plan func(string) string) []string {
		ids := make([]string, runs)
		var wg sync.WaitGroup
		for i := range runs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("%s-%s-%d", tag, prefix, i)
				resp, err := orchs[i%len(orchs)].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan(key),
					IdempotencyKey: key, Timeout: durationpb.New(90 * time.Second)})
				if err != nil {
					t.Errorf("run %s: %v", key, err)
					return
				}
				ids[i] = resp.GetRun().GetRunId()
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		return ids
	}
	wait := func(ids []string) []store.Run {
		out := make([]store.Run, len(ids))
		for i, id := range ids {
			for {
				run, err := st.GetRun(ctx, md.DefaultTenant, id)
				if err == nil && run.Status.Terminal() {
					out[i] = run
					break
				}
				if ctx.Err() != nil {
					t.Fatalf("run %s still %s: %v", id, run.Status, ctx.Err())
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
		return out
	}
	quick := func(key string) string {
		return fmt.Sprintf(`{"tokens_per_second": 1000, "steps": [{"think_tokens": 1, "tools": [
		  {"name": "kv_put", "args": {"key": %q, "value": 1}},
		  {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [{"answer_tokens": 1}]}}}]},
		  {"answer_tokens": 1}]}`, key)
	}
	for _, r := range wait(start("warm", quick)) {
		if r.Status != store.StatusSucceeded {
			t.Fatalf("warm-up run %s ended %s: %s", r.RunID, r.Status, r.Error)
		}
	}

	ids := start("cut", calleeKillPlan)
	time.Sleep(1500 * time.Millisecond)
	for _, svc := range []string{"modelproxy", "toolrunner", "subagent"} {
		if err := replicas[svc][0].Kill(); err != nil {
			t.Fatal(err)
		}
	}
	killed := time.Now()
	var failed []string
	for i, r := range wait(ids) {
		if r.Status != store.StatusSucceeded {
			failed = append(failed, fmt.Sprintf("run %s ended %s: %s %s", r.RunID, r.Status, r.Cause, r.Error))
			continue
		}
		key := fmt.Sprintf("%s-cut-%d", tag, i)
		if kv, err := st.GetKV(ctx, md.DefaultTenant, key); err != nil || kv.Version != 1 {
			t.Errorf("kv %s: version %d (%v), want written once", key, kv.Version, err)
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d runs failed after their callees were killed:\n%s", len(failed), runs, strings.Join(failed, "\n"))
	}
	t.Logf("all %d runs succeeded %v after one replica of each executor was killed", runs, time.Since(killed).Round(time.Millisecond))
}
