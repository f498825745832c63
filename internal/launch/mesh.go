package launch

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"
)

// Config is a mesh to start: the four services, each on its endpoint, wired to its peers.
type Config struct {
	Bins      map[string]string   // each service's binary (FindBinaries)
	Endpoints map[string]Endpoint // each service's addresses (Allocate)
	LogDir    string              // each service's output goes to LogDir/<service>.log
	// TLSDir holds the mesh's mTLS files (PrepareTLS): WaitServing asks as curfew-cli
	// with them. "" when the services run plaintext.
	TLSDir string
	// Args are extra flags per service, after its addresses and peers (the service's
	// own --tls-dir or --insecure among them).
	Args map[string][]string
	// StopGrace is how long Stop waits for each service after its SIGTERM before it
	// kills it; DefaultStopGrace when 0.
	StopGrace time.Duration
	// Log receives the library logs of WaitServing's credentials (a certificate
	// loaded); slog.Default when nil.
	Log *slog.Logger
}

// DefaultStopGrace is Config.StopGrace's default.
const DefaultStopGrace = 10 * time.Second

// Mesh is the four service processes of one mesh.
type Mesh struct {
	procs     []*Process // in start order (Services)
	tlsDir    string
	log       *slog.Logger
	stopGrace time.Duration
}

// Start starts the four services in order without waiting for them (WaitServing does);
// on an error it stops those it started.
func Start(cfg Config) (*Mesh, error) {
	m := &Mesh{tlsDir: cfg.TLSDir, log: cfg.Log, stopGrace: cfg.StopGrace}
	if m.stopGrace == 0 {
		m.stopGrace = DefaultStopGrace
	}
	for _, name := range Services {
		ep := cfg.Endpoints[name]
		args := append([]string{"--addr", ep.Addr, "--admin-addr", ep.AdminAddr}, PeerFlags(name, cfg.Endpoints)...)
		if ep.OpenAIAddr != "" {
			args = append(args, "--openai-addr", ep.OpenAIAddr)
		}
		if ep.ConsoleAddr != "" {
			args = append(args, "--console-addr", ep.ConsoleAddr)
		}
		p := &Process{Name: name, Bin: cfg.Bins[name], Args: append(args, cfg.Args[name]...),
			Addr: ep.Addr, AdminAddr: ep.AdminAddr, OpenAIAddr: ep.OpenAIAddr, ConsoleAddr: ep.ConsoleAddr, Log: filepath.Join(cfg.LogDir, name+".log")}
		if err := p.Start(); err != nil {
			m.Stop()
			return nil, err
		}
		m.procs = append(m.procs, p)
	}
	return m, nil
}

// Processes are the mesh's processes in start order.
func (m *Mesh) Processes() []*Process { return m.procs }

// Endpoints are where the services listen, with their process ids.
func (m *Mesh) Endpoints() map[string]Endpoint {
	eps := map[string]Endpoint{}
	for _, p := range m.procs {
		eps[p.Name] = Endpoint{Addr: p.Addr, AdminAddr: p.AdminAddr, OpenAIAddr: p.OpenAIAddr, ConsoleAddr: p.ConsoleAddr, PID: p.PID()}
	}
	return eps
}

// WaitServing waits until every service reports SERVING, all within timeout, asking as
// curfew-cli with the mesh's mTLS files.
func (m *Mesh) WaitServing(ctx context.Context, timeout time.Duration) error {
	for _, p := range m.procs {
		creds, err := ClientCredentials(m.tlsDir, p.Name, m.log)
		if err != nil {
			return err
		}
		p.Creds = creds
	}
	return WaitServing(ctx, timeout, m.procs...)
}

// Wait blocks until a service exits, and returns it, or until ctx is done (nil).
func (m *Mesh) Wait(ctx context.Context) *Process {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	exited := make(chan *Process, len(m.procs))
	for _, p := range m.procs {
		go func() {
			select {
			case <-p.Done():
				exited <- p
			case <-ctx.Done():
			}
		}()
	}
	select {
	case p := <-exited:
		return p
	case <-ctx.Done():
		return nil
	}
}

// Stop stops the services in reverse order, the orchestrator first, so that its runs
// end or are handed over while the rest still serve; each gets the stop grace before it
// is killed.
func (m *Mesh) Stop() {
	for i := len(m.procs) - 1; i >= 0; i-- {
		_ = m.procs[i].Stop(m.stopGrace)
	}
}
