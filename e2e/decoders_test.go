package e2e

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// controlBound is how long a freeze may take to stop decoders on every replica: the
// modelproxies' poll (at most 1 s) and a margin for a loaded machine.
const controlBound = time.Second + 2*time.Second

// One orchestrator and two modelproxy replicas behind one DNS name, on a shared store:
// `curfew leases ls` lists the decoders of both; `curfew ledger freeze` of a run stops
// its decoders on both within the poll bound, their nodes cancelled by the operator, and
// no new one starts; CancelLeases --older-than ends the old decoders of another run; the
// audit log holds each step with its reason.
func TestDecoderControlsAcrossReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "curfew-decoders-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	dsn := "sqlite://" + filepath.Join(dir, "curfew.db")
	c, err := meshproc.NewCluster(ctx, dir, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if !t.Failed() {
			_ = os.RemoveAll(dir)
		} else {
			t.Logf("process logs are in %s", dir)
		}
	})
	// An operator's key (admin scope): over plaintext the CLI and the test authenticate
	// with a key.
	adminKey := func() string {
		st, err := store.Open(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = st.Close() }()
		k, err := apikey.New("ops")
		if err != nil {
			t.Fatal(err)
		}
		k.Record.Scopes = []string{store.ScopeAdmin}
		if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
			t.Fatal(err)
		}
		return k.Secret
	}()

	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	dnsAddr := serveDNS(t, "modelproxy.curfew.test", "127.0.0.1", "127.0.0.2")
	target := "dns://" + dnsAddr + "/modelproxy.curfew.test:" + strconv.Itoa(port)
	var models []*meshproc.Proc
	for i, ip := range []string{"127.0.0.1", "127.0.0.2"} {
		p, err := c.AddAt(ctx, "modelproxy", "modelproxy-"+string(rune('a'+i)), net.JoinHostPort(ip, strconv.Itoa(port)), "--store", c.Store)
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
	orch, err := c.Add(ctx, "orchestrator", "orchestrator", "--store", c.Store, "--modelproxy", target, "--toolrunner", tools.Addr, "--subagent", sub.Addr)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range append(models, tools, sub, orch) {
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
	}
	cc, err := c.Conn(orch)
	if err != nil {
		t.Fatal(err)
	}
	oc := orchestratorv1.NewOrchestratorServiceClient(cc)
	acc, err := grpc.NewClient(orch.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(apikey.Bearer(adminKey)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = acc.Close() })
	adm := adminv1.NewAdminServiceClient(acc)
	cli := func(args ...string) []byte {
		t.Helper()
		cmd := exec.CommandContext(ctx, c.Bin("curfew"), append(args, "--addr", orch.Addr, "--insecure")...)
		cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+adminKey)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("curfew %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	// Each replica's own view, read directly.
	ownDecoders := func(p *meshproc.Proc) []*modelproxyv1.Decoder {
		t.Helper()
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := modelproxyv1.NewModelProxyServiceClient(conn).ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{})
		if err != nil {
			t.Fatalf("%s ListDecoders: %v", p.Name, err)
		}
		return resp.GetDecoders()
	}
	ownModelNodes := func(p *meshproc.Proc, run string) []*meshv1.Node {
		t.Helper()
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := meshv1.NewNodeReportServiceClient(conn).ListNodes(ctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second)})
		if err != nil {
			t.Fatalf("%s ListNodes: %v", p.Name, err)
		}
		return resp.GetNodes()
	}
	// A run whose six subagents decode for minutes at 20 tokens/s: its decoders spread
	// over both replicas (the subagent's connection balances over the name's addresses).
	spawns := func(n int, tokens int) string {
		child := `{"name":"spawn_subagent","args":{"plan":{"tokens_per_second":20,"steps":[{"answer_tokens":` + strconv.Itoa(tokens) + `}]}}}`
		return `{"tokens_per_second":1000,"steps":[{"think_tokens":1,"tools":[` + strings.TrimSuffix(strings.Repeat(child+",", n), ",") + `]},{"answer_tokens":1}]}`
	}
	// A warm-up run connects the subagent and the orchestrator to both replicas.
	if res, _ := runPlan(ctx, oc, spawns(4, 2), 60*time.Second, 0, false); res.err != nil {
		t.Fatalf("warm-up run: %v", res.err)
	}
	time.Sleep(200 * time.Millisecond)
	began := time.Now().Add(-time.Second)

	start := func(plan string) string {
		t.Helper()
		r, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(2 * time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetRun().GetRunId()
	}
	// leasesOf lists the leases of run through the CLI, by replica.
	leasesOf := func(run string) map[string]int {
		t.Helper()
		var resp adminv1.ListLeasesResponse
		out := cli("leases", "ls", "--json")
		if err := protojson.Unmarshal(out, &resp); err != nil {
			t.Fatalf("curfew leases ls --json printed %s: %v", out, err)
		}
		if len(resp.GetUnreachable()) > 0 {
			t.Fatalf("unreachable replicas: %v", resp.GetUnreachable())
		}
		by := map[string]int{}
		for _, l := range resp.GetLeases() {
			if l.GetRunId() == run {
				by[l.GetReplica()]++
			}
		}
		return by
	}
	frozen := start(spawns(6, 100_000))
	for deadline := time.Now().Add(30 * time.Second); ; {
		by := leasesOf(frozen)
		n := 0
		for _, v := range by {
			n += v
		}
		if len(by) == 2 && n == 6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("curfew leases ls shows the run's decoders on %v, want its 6 on both replicas", by)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, p := range models {
		for _, d := range ownDecoders(p) {
			if d.GetRunId() == frozen && (d.GetPool() != "paid" || d.GetTenant() != md.DefaultTenant) {
				t.Errorf("%s: decoder %v, want the run's pool (paid, curfew-pool) and tenant", p.Name, d)
			}
		}
	}

	// The freeze, through one orchestrator, stops the run's decoders on both replicas.
	cli("ledger", "freeze", "--run", frozen, "--reason", "e2e: orphan leak")
	froze := time.Now()
	for {
		by := leasesOf(frozen)
		if len(by) == 0 {
			break
		}
		if time.Since(froze) > controlBound {
			t.Fatalf("%v after the freeze the run still has decoders: %v", controlBound, by)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, p := range models {
		cancelled := 0
		for _, n := range ownModelNodes(p, frozen) {
			if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL || n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				continue
			}
			if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED && n.GetCause() == meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
				cancelled++
			}
		}
		if cancelled == 0 {
			t.Errorf("%s: no model node of the frozen run cancelled by the operator", p.Name)
		}
	}
	// No new decoder starts for it: the frozen run's subagents' next model calls are
	// refused, and none shows up.
	time.Sleep(500 * time.Millisecond)
	if by := leasesOf(frozen); len(by) != 0 {
		t.Fatalf("a decoder of the frozen run started after the freeze: %v", by)
	}
	fz, err := adm.ListFreezes(ctx, &adminv1.ListFreezesRequest{})
	if err != nil || len(fz.GetFreezes()) != 1 || fz.GetFreezes()[0].GetRunId() != frozen || fz.GetFreezes()[0].GetTenant() != md.DefaultTenant {
		t.Fatalf("ListFreezes = %v, %v; want the run's freeze, its tenant resolved", fz, err)
	}
	// What its six decoders decoded after the freeze cancelled them is reported as
	// orphans: it settles once their ledger entries are written, at most the one token
	// per decoder that may be in flight at a cancel.
	after := func() int64 {
		t.Helper()
		fz, err := adm.ListFreezes(ctx, &adminv1.ListFreezesRequest{})
		if err != nil || len(fz.GetFreezes()) != 1 {
			t.Fatalf("ListFreezes = %v, %v", fz, err)
		}
		return fz.GetFreezes()[0].GetTokensAfterFreeze()
	}
	time.Sleep(2 * time.Second) // modelproxy writes the ledger in batches, within a second
	settled := after()
	time.Sleep(time.Second)
	if again := after(); again != settled || settled > 6 {
		t.Errorf("tokens after the freeze: %d, then %d a second later; want them settled and at most 6 (one per decoder)", settled, again)
	}

	// Another run's decoders, cancelled once older than a bound.
	old := start(spawns(2, 100_000))
	for deadline := time.Now().Add(30 * time.Second); ; {
		n := 0
		for _, v := range leasesOf(old) {
			n += v
		}
		if n == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second run's decoders did not start")
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(time.Second)
	cr, err := adm.CancelLeases(ctx, &adminv1.CancelLeasesRequest{OlderThan: durationpb.New(500 * time.Millisecond), Reason: "e2e: older than the grace"})
	if err != nil {
		t.Fatal(err)
	}
	if len(cr.GetUnreachable()) > 0 {
		t.Fatalf("CancelLeases: unreachable %v", cr.GetUnreachable())
	}
	mine := 0
	for _, l := range cr.GetCancelled() {
		if l.GetRunId() == old {
			mine++
		}
	}
	if mine != 2 {
		t.Fatalf("CancelLeases cancelled %v, want the second run's 2 decoders", cr.GetCancelled())
	}
	for deadline := time.Now().Add(controlBound); len(leasesOf(old)) != 0; {
		if time.Now().After(deadline) {
			t.Fatal("the cancelled decoders still run")
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancelledOld := 0
	for _, p := range models {
		for _, n := range ownModelNodes(p, old) {
			if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED && n.GetCause() == meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
				cancelledOld++
			}
		}
	}
	if cancelledOld < 2 {
		t.Errorf("%d model nodes of the second run cancelled by the operator, want its 2 decoders'", cancelledOld)
	}

	// A drain of the paid pool, on real processes: modelproxy knows each call's pool only
	// from curfew-pool, which the orchestrator stamps from the run's admission ticket. A
	// new paid run is refused its model call on either replica; an overflow run still
	// decodes; after the undrain paid runs decode again.
	cli("decoders", "drain", "--pool", "paid", "--reason", "e2e: drain paid")
	sheddable := metadata.AppendToOutgoingContext(ctx, md.Criticality, "sheddable")
	for deadline := time.Now().Add(controlBound); ; time.Sleep(50 * time.Millisecond) {
		res, _ := runPlan(ctx, oc, spawns(2, 2), 30*time.Second, 0, false)
		if res.err != nil && strings.Contains(res.err.Error(), "decoders drained") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a paid run within %v of the drain: %v, want its model call refused (decoders drained)", controlBound, res.err)
		}
	}
	for range 4 { // both replicas serve the overflow runs' calls
		if res, _ := runPlan(sheddable, oc, spawns(2, 2), 30*time.Second, 0, false); res.err != nil {
			t.Fatalf("an overflow run while only paid is drained: %v", res.err)
		}
	}
	for range 4 {
		if res, _ := runPlan(ctx, oc, spawns(2, 2), 30*time.Second, 0, false); res.err == nil || !strings.Contains(res.err.Error(), "decoders drained") {
			t.Fatalf("a paid run while drained: %v, want decoders drained", res.err)
		}
	}
	cli("decoders", "undrain", "--pool", "paid", "--reason", "e2e: undrain paid")
	for deadline := time.Now().Add(controlBound); ; time.Sleep(50 * time.Millisecond) {
		res, _ := runPlan(ctx, oc, spawns(2, 2), 30*time.Second, 0, false)
		if res.err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a paid run after the undrain: %v", res.err)
		}
	}

	// Thaw, and the audit log lists each step with its reason.
	cli("ledger", "thaw", "--run", frozen, "--reason", "e2e: leak fixed")
	audit, err := adm.ListAudit(ctx, &adminv1.ListAuditRequest{Since: timestamppb.New(began), PageSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"FreezeLedger": "e2e: orphan leak", "CancelLeases": "e2e: older than the grace", "ThawLedger": "e2e: leak fixed",
		"DrainDecoders": "e2e: drain paid", "UndrainDecoders": "e2e: undrain paid"}
	for _, e := range audit.GetEntries() {
		if r, ok := want[e.GetAction()]; ok && e.GetReason() == r && strings.HasPrefix(e.GetActor(), "key:") {
			delete(want, e.GetAction())
		}
	}
	if len(want) > 0 {
		t.Errorf("the audit log lacks %v:\n%v", want, audit.GetEntries())
	}
}

// Over the shared mesh's mTLS: the orchestrator's fan-out reaches modelproxy as the
// orchestrator identity (the call graph allows ListDecoders to it alone), and a mesh
// peer that is not the orchestrator is refused ListDecoders and CancelDecoders.
func TestDecoderRPCsOverMTLS(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	requireTLS(t)
	oc, err := mesh.Conn("orchestrator")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = oc.Close() }()
	ls, err := adminv1.NewAdminServiceClient(oc).ListLeases(ctx, &adminv1.ListLeasesRequest{})
	if err != nil || len(ls.GetUnreachable()) != 0 {
		t.Fatalf("ListLeases as curfew-cli = %v, %v; want every modelproxy replica answering", ls, err)
	}
	for _, who := range []string{"curfew-cli", "subagent"} {
		mc, err := mesh.ConnAs(who, "modelproxy")
		if err != nil {
			t.Fatal(err)
		}
		c := modelproxyv1.NewModelProxyServiceClient(mc)
		if _, err := c.ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{}); status.Code(err) != codes.PermissionDenied {
			t.Errorf("ListDecoders as %s: %v, want PERMISSION_DENIED", who, err)
		}
		if _, err := c.CancelDecoders(ctx, &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(time.Millisecond)}); status.Code(err) != codes.PermissionDenied {
			t.Errorf("CancelDecoders as %s: %v, want PERMISSION_DENIED", who, err)
		}
		_ = mc.Close()
	}
}
