package drill

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/curfew-mesh/curfew/internal/launch"
)

// Mesh is the drill's own mesh: the four services on free loopback ports, with --chaos,
// the paid pool capped at 2 and the drill's lease settings, in a temporary data directory
// removed with it (seed 003: park the drill on an isolated replica, then tear it down).
type Mesh struct {
	Addr   string // the orchestrator's address
	TLSDir string // the mesh's mTLS files: connect as curfew-cli with them
	dir    string
	mesh   *launch.Mesh
}

// startTries is how often StartMesh tries: free ports are picked, released, then bound
// by the services, and another process may take one meanwhile (drills run side by side).
const startTries = 3

// StartMesh starts the drill's mesh from the service binaries in binDir (see
// launch.FindBinaries) and waits until it serves. log receives the library logs of the
// readiness checks.
func StartMesh(ctx context.Context, cfg Config, binDir string, log *slog.Logger) (*Mesh, error) {
	var m *Mesh
	var err error
	for range startTries {
		if m, err = startMesh(ctx, cfg, binDir, log); err == nil || ctx.Err() != nil {
			break
		}
	}
	return m, err
}

func startMesh(ctx context.Context, cfg Config, binDir string, log *slog.Logger) (*Mesh, error) {
	bins, err := launch.FindBinaries(binDir)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "curfew-drill-")
	if err != nil {
		return nil, err
	}
	m := &Mesh{dir: dir}
	adm := map[string]any{"pools": []map[string]any{
		{"name": "paid", "max_in_flight": paidCap},
		{"name": "overflow", "max_in_flight": max(cfg.Tasks, 1), "overflow": true},
	}}
	b, _ := json.Marshal(adm)
	admFile := filepath.Join(dir, "admission.json")
	if err := os.WriteFile(admFile, b, 0o600); err != nil {
		m.Stop()
		return nil, err
	}
	logs := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logs, 0o755); err != nil { //nolint:gosec // the drill mesh's logs, which hold no secrets
		m.Stop()
		return nil, err
	}
	eps, err := launch.Allocate(0)
	if err != nil {
		m.Stop()
		return nil, err
	}
	if m.TLSDir, err = launch.PrepareTLS(filepath.Join(dir, launch.TLSSubdir)); err != nil {
		m.Stop()
		return nil, err
	}
	args := map[string][]string{
		"orchestrator": {"--admission-config", admFile, "--decoder-heartbeat", cfg.Heartbeat.String(), "--decoder-lease-ttl", cfg.LeaseTTL.String()},
		"modelproxy":   {"--decoder-lease-ttl", cfg.LeaseTTL.String()},
	}
	for _, name := range launch.Services {
		args[name] = append([]string{"--chaos", "--shutdown-grace", "2s", "--tls-dir", m.TLSDir}, args[name]...)
	}
	m.mesh, err = launch.Start(launch.Config{Bins: bins, Endpoints: eps, LogDir: logs, TLSDir: m.TLSDir,
		Args: args, StopGrace: 5 * time.Second, Log: log})
	if err != nil {
		m.Stop()
		return nil, err
	}
	if err := m.mesh.WaitServing(ctx, 30*time.Second); err != nil {
		m.Stop()
		return nil, fmt.Errorf("%w (logs in %s)", err, logs)
	}
	m.Addr = eps["orchestrator"].Addr
	return m, nil
}

// Stop stops the mesh and removes its data directory.
func (m *Mesh) Stop() {
	if m.mesh != nil {
		m.mesh.Stop()
	}
	_ = os.RemoveAll(m.dir)
}
