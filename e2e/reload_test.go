package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// reloadAdmission is the shared admission file of TestAdmissionReloadOnTwoReplicas: one
// paid pool of maxInFlight runs whose queued runs are shed after 300 ms, so that a run
// beyond the limit is refused quickly.
func reloadAdmission(maxInFlight int) string {
	return fmt.Sprintf(`{"pools": [{"name": "paid", "max_in_flight": %d, "max_queue_age": "300ms"},
	  {"name": "overflow", "max_in_flight": 8, "overflow": true}]}`, maxInFlight)
}

// holdPlan holds its pool slot for a minute, until the test cancels it.
const holdPlan = `{"steps":[{"tools":[{"name":"sleep","args":{"ms":60000}}]},{"answer_tokens":1}]}`

// Issue 22's acceptance of live configuration: two orchestrators share one PostgreSQL
// store and one admission file. A bad rewrite keeps the running limits on both (the
// failure counter goes up on each /metrics, each log says why, the store shows the
// error beside the old version); a good rewrite raises the paid pool's MaxInFlight on
// both without a restart: a second run that was shed is now admitted.
func TestAdmissionReloadOnTwoReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := storetest.PostgresDSN(t)
	c := newCluster(ctx, t, "reload", dsn)
	dir := c.Dir
	adm := filepath.Join(dir, "admission.json")
	writeFile(t, adm, reloadAdmission(1))
	model, sub, tools, err := c.Mesh(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var orchs []*meshproc.Proc
	var clients []orchestratorv1.OrchestratorServiceClient
	// Each replica's own limits: this test is about every replica reloading its file.
	// The caps shared across replicas, and their reload, are cluster_admission_test.go's
	// and mesh/admission's.
	for _, name := range []string{"orchestrator-a", "orchestrator-b"} {
		p, err := c.Add(ctx, "orchestrator", name, c.OrchestratorArgs(model, sub, tools, "--admission-config", adm, "--cluster-admission=false")...)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatal(err)
		}
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		orchs, clients = append(orchs, p), append(clients, orchestratorv1.NewOrchestratorServiceClient(conn))
	}
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })

	// Both replicas record the file's version.
	rows := waitReplicaConfigs(ctx, t, st, "the first version on both replicas", func(rs []store.ReplicaConfig) bool {
		return len(rs) == 2 && rs[0].Version != "" && rs[0].Version == rs[1].Version
	})
	v1 := rows[0].Version

	// With one slot, a second run on each replica is shed from the queue.
	var held []string
	hold := func(oc orchestratorv1.OrchestratorServiceClient) {
		t.Helper()
		resp, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: holdPlan, Timeout: durationpb.New(2 * time.Minute)})
		if err != nil {
			t.Fatalf("StartRun of the run that holds the slot: %v", err)
		}
		held = append(held, resp.GetRun().GetRunId())
	}
	t.Cleanup(func() {
		cctx, ccancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer ccancel()
		for _, id := range held {
			_, _ = clients[0].CancelRun(cctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "test over"})
		}
	})
	shed := func(oc orchestratorv1.OrchestratorServiceClient, name string) {
		t.Helper()
		_, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: holdPlan, Timeout: durationpb.New(2 * time.Minute)})
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("%s: a run beyond the pool's one slot: %v, want RESOURCE_EXHAUSTED (shed)", name, err)
		}
	}
	for i, oc := range clients {
		hold(oc)
		shed(oc, orchs[i].Name)
	}

	// A bad rewrite: refused on both, the old limit kept.
	writeFile(t, adm, reloadAdmission(0))
	for _, p := range orchs {
		waitMetrics(ctx, t, p, `curfew_config_reload_failures_total{config="admission",service="orchestrator"} 1`)
		waitLogLine(ctx, t, p, "configuration reload failed", "max_in_flight")
	}
	waitReplicaConfigs(ctx, t, st, "the failure beside the first version on both", func(rs []store.ReplicaConfig) bool {
		return len(rs) == 2 && rs[0].Version == v1 && rs[1].Version == v1 &&
			strings.Contains(rs[0].LastError, "max_in_flight") && strings.Contains(rs[1].LastError, "max_in_flight")
	})
	for i, oc := range clients {
		shed(oc, orchs[i].Name)
	}

	// A good rewrite: two slots on both replicas, without a restart.
	writeFile(t, adm, reloadAdmission(2))
	waitReplicaConfigs(ctx, t, st, "the second version on both", func(rs []store.ReplicaConfig) bool {
		return len(rs) == 2 && rs[0].Version != v1 && rs[0].Version == rs[1].Version && rs[0].LastError == "" && rs[1].LastError == ""
	})
	for _, oc := range clients {
		hold(oc) // the second slot
	}
	for _, p := range orchs {
		waitMetrics(ctx, t, p, `curfew_config_reloads_total{config="admission",service="orchestrator"} 1`)
		if !p.Running() {
			t.Fatalf("%s is not running: the reload restarted it", p.Name)
		}
	}
	// curfew status on each replica shows its new limit and both replicas' new version.
	k, err := apikey.New("ops")
	if err != nil {
		t.Fatal(err)
	}
	k.Record.Scopes = []string{store.ScopeReadOnly}
	if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
		t.Fatal(err)
	}
	for _, p := range orchs {
		cmd := exec.CommandContext(ctx, c.Bin("curfew"), "status", "--json", "--addr", p.Addr, "--insecure")
		cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+k.Secret)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("curfew status on %s: %v", p.Name, err)
		}
		var resp adminv1.StatusResponse
		if err := protojson.Unmarshal(out, &resp); err != nil {
			t.Fatalf("curfew status --json: %v: %s", err, out)
		}
		var paid *adminv1.PoolState
		for _, ps := range resp.GetPools() {
			if ps.GetPool() == "paid" {
				paid = ps
			}
		}
		if paid.GetMaxInFlight() != 2 || paid.GetInFlight() != 2 {
			t.Errorf("%s: status of the paid pool %v, want 2 of 2 in flight", p.Name, paid)
		}
		versions := map[string]string{}
		for _, rc := range resp.GetConfigs() {
			if rc.GetService() == "orchestrator" && rc.GetConfig() == "admission" {
				versions[rc.GetReplica()] = rc.GetVersion()
			}
		}
		if len(versions) != 2 {
			t.Errorf("%s: status lists the admission version of %v, want both replicas", p.Name, versions)
		}
		for r, v := range versions {
			if v == v1 {
				t.Errorf("%s: status shows %s still on the first version", p.Name, r)
			}
		}
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// waitReplicaConfigs polls the orchestrators' admission rows of store.Replicas until ok
// holds, and returns them.
func waitReplicaConfigs(ctx context.Context, t *testing.T, st store.Store, what string, ok func([]store.ReplicaConfig) bool) []store.ReplicaConfig {
	t.Helper()
	var last []store.ReplicaConfig
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		rs, err := st.ListReplicaConfigs(ctx, "orchestrator")
		if err != nil {
			t.Fatal(err)
		}
		last = last[:0]
		for _, r := range rs {
			if r.Config == "admission" {
				last = append(last, r)
			}
		}
		if ok(last) {
			return last
		}
	}
	t.Fatalf("timed out waiting for %s; the rows are %+v", what, last)
	return nil
}

// waitMetrics polls p's /metrics until it has the line want.
func waitMetrics(ctx context.Context, t *testing.T, p *meshproc.Proc, want string) {
	t.Helper()
	body := ""
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end) && ctx.Err() == nil; time.Sleep(100 * time.Millisecond) {
		var err error
		if body, err = httpGet("http://" + p.AdminAddr + "/metrics"); err == nil && strings.Contains(body, want+"\n") {
			return
		}
	}
	t.Fatalf("%s /metrics never had %q:\n%s", p.Name, want, grepLines(body, "curfew_config"))
}

// waitLogLine polls p's log until one line holds every one of subs.
func waitLogLine(ctx context.Context, t *testing.T, p *meshproc.Proc, subs ...string) {
	t.Helper()
	for end := time.Now().Add(60 * time.Second); time.Now().Before(end) && ctx.Err() == nil; time.Sleep(100 * time.Millisecond) {
		data, _ := os.ReadFile(p.Log) //nolint:gosec // the cluster's log file
	lines:
		for _, l := range strings.Split(string(data), "\n") {
			for _, s := range subs {
				if !strings.Contains(l, s) {
					continue lines
				}
			}
			return
		}
	}
	t.Fatalf("%s's log never had a line with %q (%s)", p.Name, subs, p.Log)
}
