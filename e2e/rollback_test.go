package e2e

import (
	"context"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Issue 22's acceptance: seed 003's drill with fault 1 (the cancel dropped on overflow
// decoders) on two orchestrators and two modelproxy replicas sharing PostgreSQL. The
// overflow runs are cancelled; their decoders decode on (orphan tokens), since their
// leases are long (3 min). An operator runs the rollback order with the curfew commands,
// each step issued to one orchestrator and taking effect on both and on both modelproxy
// replicas: close the overflow pool, cancel the leases older than the grace, freeze the
// tenant's ledger, drain the pool's decoders, reopen once the orphan delta has stayed
// zero. Afterwards the orphan delta is zero, the pool reopened only after its window,
// and the audit log lists each step with its reason.
func TestRollbackOrderOnTwoReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	oc := newOpsBase(ctx, t, "rollback")
	c, st := oc.Cluster, oc.st

	// Two modelproxy replicas behind one DNS name, as two pods of a headless Service.
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	target := "dns://" + serveDNS(t, "modelproxy.curfew.test", "127.0.0.1", "127.0.0.2") + "/modelproxy.curfew.test:" + strconv.Itoa(port)
	var models []*meshproc.Proc
	for i, ip := range []string{"127.0.0.1", "127.0.0.2"} {
		p, err := c.AddAt(ctx, "modelproxy", "modelproxy-"+string(rune('a'+i)), net.JoinHostPort(ip, strconv.Itoa(port)),
			"--store", c.Store, "--chaos", "--controls-poll", "200ms")
		if err != nil {
			t.Fatal(err)
		}
		models = append(models, p)
	}
	sub, err := c.Add(ctx, "subagent", "subagent", "--modelproxy", target)
	if err != nil {
		t.Fatal(err)
	}
	tools, err := c.Add(ctx, "toolrunner", "toolrunner", "--store", c.Store, "--subagent", sub.Addr)
	if err != nil {
		t.Fatal(err)
	}
	sub.Args = append(sub.Args, "--toolrunner", tools.Addr)
	for _, p := range append(models, tools, sub) {
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
	}
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, `{"pools": [{"name": "paid", "max_in_flight": 16}, {"name": "overflow", "max_in_flight": 16, "overflow": true}],
	  "fail_closed_window": "4s"}`)
	for _, n := range []string{"orchestrator-a", "orchestrator-b"} {
		oc.addOrchestrator(ctx, t, n, "--store", c.Store, "--modelproxy", target, "--toolrunner", tools.Addr, "--subagent", sub.Addr,
			"--chaos", "--admission-config", adm, "--operator-poll", "200ms", "--decoder-heartbeat", "20s", "--decoder-lease-ttl", "3m")
	}

	// Fault 1: six overflow runs whose decoders ignore their cancel, three on each
	// orchestrator, decoding slowly.
	overflowCtx := metadata.AppendToOutgoingContext(ctx, md.Criticality, "sheddable", md.Chaos, "drop-cancel")
	var runIDs []string
	for i := range 6 {
		resp, err := oc.runs[i%2].StartRun(overflowCtx, &orchestratorv1.StartRunRequest{
			Task: `{"tokens_per_second": 20, "steps": [{"answer_tokens": 5000}]}`, Timeout: durationpb.New(3 * time.Minute)})
		if err != nil {
			t.Fatalf("overflow run %d: %v", i, err)
		}
		runIDs = append(runIDs, resp.GetRun().GetRunId())
	}
	leases := func(i int) []*adminv1.Lease {
		resp, err := oc.admins[i].ListLeases(ctx, &adminv1.ListLeasesRequest{})
		if err != nil {
			t.Fatalf("ListLeases: %v", err)
		}
		if len(resp.GetUnreachable()) > 0 {
			t.Fatalf("ListLeases: unreachable %v", resp.GetUnreachable())
		}
		return resp.GetLeases()
	}
	waitFor(t, "six decoders on the two modelproxy replicas", 30*time.Second, func() bool {
		ls := leases(0)
		replicas := map[string]bool{}
		for _, l := range ls {
			replicas[l.GetReplica()] = true
		}
		return len(ls) == 6 && len(replicas) == 2
	})
	// The cancels in parallel: each waits for its decoders, which the fault keeps going,
	// for the cancel's bound (about 12 s).
	var wg sync.WaitGroup
	for _, id := range runIDs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := oc.runs[0].CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "the user left"}); err != nil {
				t.Errorf("CancelRun %s: %v", id, err)
			}
		}()
	}
	wg.Wait()
	orphans := func() int64 {
		n, err := st.SumTokens(ctx, store.TokenQuery{Kind: store.KindOrphan})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := len(leases(1)); n != 6 {
		t.Fatalf("after the cancels %d decoders run, want the six the fault keeps decoding", n)
	}

	// 1. Close the overflow pool (orchestrator-a); orchestrator-b sheds it too.
	step := func(i int, args ...string) string {
		t.Helper()
		out, code := oc.cli(ctx, t, i, args...)
		if code != 0 {
			t.Fatalf("curfew %s on %s: exit %d:\n%s", strings.Join(args, " "), oc.orchs[i].Name, code, out)
		}
		t.Logf("curfew %s (%s):\n%s", strings.Join(args, " "), oc.orchs[i].Name, out)
		return out
	}
	step(0, "pool", "close", "overflow", "--reason", "1: cancel path unproven")
	waitFor(t, "orchestrator-b sheds the closed overflow pool", 5*time.Second, func() bool {
		return shedCondition(oc.sheddable(ctx, 1)) == "operator"
	})

	// 2. Cancel the leases older than the grace (orchestrator-b): on both modelproxies.
	out := step(1, "leases", "ls", "--older-than", "1s")
	for _, l := range leases(1) {
		if !strings.Contains(out, l.GetRunId()) || !strings.Contains(out, l.GetReplica()) {
			t.Errorf("curfew leases ls does not list the decoder of run %s on %s", l.GetRunId(), l.GetReplica())
		}
	}
	if out := step(1, "leases", "cancel", "--older-than", "1s", "--reason", "2: past the cancel grace"); !strings.Contains(out, "cancelled 6 decoders") {
		t.Errorf("curfew leases cancel: %s, want the six decoders the fault kept going named", out)
	}
	waitFor(t, "no decoder left on either replica", 10*time.Second, func() bool { return len(leases(0)) == 0 })
	// The fault's cost lands in the ledger as each decoder ends: tokens after the cancel.
	waitFor(t, "the orphan tokens of the cancelled decoders in the ledger", 10*time.Second, func() bool { return orphans() > 0 })
	t.Logf("the fault cost %d orphan tokens", orphans())

	// 3. Freeze the tenant's ledger (orchestrator-a), 4. drain the overflow decoders
	// (orchestrator-b).
	step(0, "ledger", "freeze", "--tenant", md.DefaultTenant, "--reason", "3: stop the charges")
	step(1, "decoders", "drain", "--pool", "overflow", "--cancel-after", "1s", "--reason", "4: no new overflow decoders")

	// 5. Reopen once the orphan delta has stayed zero for 3 s (orchestrator-a).
	began := time.Now()
	out = step(0, "pool", "reopen", "overflow", "--when-orphan-delta-zero", "3s", "--reason", "5: orphan delta zero", "--wait", "2m")
	if took := time.Since(began); took < 3*time.Second || !strings.Contains(out, "opened") {
		t.Errorf("reopen returned after %v: %s; want it open only after the 3 s window", took, out)
	}
	before := orphans()
	time.Sleep(2 * time.Second)
	if after := orphans(); after != before {
		t.Errorf("orphan tokens still grow after the rollback: %d then %d", before, after)
	}
	for i := range oc.orchs {
		st, err := oc.admins[i].Status(ctx, &adminv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(st.GetLeases()) != 0 {
			t.Errorf("%s: status lists decoders after the rollback: %v", oc.orchs[i].Name, st.GetLeases())
		}
		for _, p := range st.GetPools() {
			if p.GetPool() == "overflow" && p.GetOperatorClosed() {
				t.Errorf("%s: overflow still closed by the operator after the reopen", oc.orchs[i].Name)
			}
		}
	}
	// Once the automatic window (4 s here) has passed too, overflow admits on both.
	for i := range oc.orchs {
		waitFor(t, oc.orchs[i].Name+" admits overflow runs again", 20*time.Second, func() bool { return oc.sheddable(ctx, i) == nil })
	}
	waitFor(t, "status's orphan delta zero once the window has passed", 20*time.Second, func() bool {
		st, err := oc.admins[1].Status(ctx, &adminv1.StatusRequest{})
		return err == nil && st.GetOrphanDelta() == 0
	})

	// The audit log lists the five steps in order, with their reasons.
	audit, err := oc.admins[1].ListAudit(ctx, &adminv1.ListAuditRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range audit.GetEntries() {
		got = append([]string{e.GetAction() + ": " + e.GetReason()}, got...)
	}
	want := []string{"ClosePool: 1: cancel path unproven", "CancelLeases: 2: past the cancel grace", "FreezeLedger: 3: stop the charges",
		"DrainDecoders: 4: no new overflow decoders", "ReopenPool: 5: orphan delta zero"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("audit, oldest first:\n got %q\nwant %q", got, want)
	}
}
