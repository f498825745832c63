package launch

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A mesh starts the four services wired to their peers, reports their endpoints, stops
// them orchestrator first, and Wait returns the service that exited.
func TestMesh(t *testing.T) {
	t.Setenv(childEnv, "serve")
	eps, err := Allocate(0)
	if err != nil {
		t.Fatal(err)
	}
	bins := map[string]string{}
	for _, s := range Services {
		bins[s] = os.Args[0]
	}
	logs := t.TempDir()
	m, err := Start(Config{Bins: bins, Endpoints: eps, LogDir: logs, Args: map[string][]string{"toolrunner": {"--extra", "x"}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := m.WaitServing(ctx, 10*time.Second); err != nil {
		m.Stop()
		t.Fatal(err)
	}
	for name, ep := range m.Endpoints() {
		if ep.Addr != eps[name].Addr || ep.AdminAddr != eps[name].AdminAddr || ep.PID == 0 {
			t.Errorf("%s: %+v, want the allocated addresses and a pid", name, ep)
		}
	}
	want := map[string]string{
		"orchestrator": "--addr " + eps["orchestrator"].Addr + " --admin-addr " + eps["orchestrator"].AdminAddr +
			" --modelproxy " + eps["modelproxy"].Addr + " --toolrunner " + eps["toolrunner"].Addr + " --subagent " + eps["subagent"].Addr,
		"subagent":   "--modelproxy " + eps["modelproxy"].Addr + " --toolrunner " + eps["toolrunner"].Addr,
		"toolrunner": "--subagent " + eps["subagent"].Addr + " --extra x",
	}
	for name, args := range want {
		if b, _ := os.ReadFile(filepath.Join(logs, name+".log")); !strings.Contains(string(b), args) {
			t.Errorf("%s started with %q, want %q in its flags", name, b, args)
		}
	}

	// Wait: a service that exits is reported; a done context reports none.
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if p := m.Wait(cctx); p != nil {
		t.Errorf("Wait returned %s with every service up", p.Name)
	}
	cancel()
	_ = m.Processes()[1].Stop(5 * time.Second) // subagent
	if p := m.Wait(ctx); p == nil || p.Name != "subagent" {
		t.Errorf("Wait returned %v, want subagent", p)
	}

	m.Stop()
	stopped := map[string]int64{}
	for _, name := range []string{"orchestrator", "toolrunner", "modelproxy"} {
		b, _ := os.ReadFile(filepath.Join(logs, name+".log"))
		_, at, _ := strings.Cut(string(b), "stopped ")
		stopped[name], _ = strconv.ParseInt(strings.TrimSpace(at), 10, 64)
	}
	if stopped["orchestrator"] == 0 || stopped["orchestrator"] >= stopped["toolrunner"] || stopped["toolrunner"] >= stopped["modelproxy"] {
		t.Errorf("stop order by time: %v, want orchestrator, toolrunner, modelproxy", stopped)
	}
}
