package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
)

// prepareStore opens the store at dsn (creating and migrating it) and closes it.
func prepareStore(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		return err
	}
	return st.Close()
}

// Endpoints is the content of DATA_DIR/endpoints.json, written by `curfew up`.
type Endpoints struct {
	Services  map[string]launch.Endpoint `json:"services"`
	StartedAt time.Time                  `json:"started_at"`
	// TLSDir is the directory of the mesh's mTLS files (DIR/tls, absolute) when the
	// services run mTLS, "" when they run plaintext (curfew up --insecure).
	TLSDir string `json:"tls_dir,omitempty"`
	// Restarts counts, per service, the times curfew up restarted it after it exited on
	// its own (--max-restarts); absent while none was.
	Restarts map[string]int `json:"restarts,omitempty"`
}

// EndpointsFile is the name of the endpoints file in the data directory.
const EndpointsFile = "endpoints.json"

// writeEndpoints writes e to DIR/endpoints.json, replacing it whole (a reader never sees
// half of it).
func writeEndpoints(dir string, e Endpoints) error {
	b, _ := json.MarshalIndent(e, "", "  ")
	tmp := filepath.Join(dir, EndpointsFile+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil { //nolint:gosec // addresses only, read by every client command
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, EndpointsFile))
}

func readEndpoints(dir string) (*Endpoints, error) {
	b, err := os.ReadFile(filepath.Join(dir, EndpointsFile)) //nolint:gosec // endpoints.json in the data directory the user names
	if err != nil {
		return nil, err
	}
	var e Endpoints
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, fmt.Errorf("%s: %w", EndpointsFile, err)
	}
	return &e, nil
}

func cmdUp(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("up", stderr)
	dataDir := fs.String("data-dir", defaultDataDir(), "data directory: endpoints.json and logs/")
	basePort := fs.Int("base-port", 7700, "first of 10 consecutive ports (gRPC and admin per service, then the orchestrator's OpenAI-compatible API and web console); 0 picks free ports")
	binDir := fs.String("bin-dir", "", "directory of the service binaries (default: next to curfew, else $PATH)")
	grace := fs.Duration("shutdown-grace", service.DefaultShutdownGrace, "each service's --shutdown-grace: how long its in-flight calls and runs get to finish on stop; a service still running after its whole stop bound (docs/leases.md#drain) is killed")
	startTimeout := fs.Duration("start-timeout", 30*time.Second, "how long to wait for every service to report SERVING")
	maxRestarts := fs.Int("max-restarts", launch.DefaultMaxRestarts, "a service that exits on its own is restarted on its addresses, after a backoff from 1s doubling to 30s (reset after a minute up), and the mesh is stopped only when one restarts more than this many times within 5 minutes (a crash loop); 0 stops the mesh at the first exit")
	asJSON := fs.Bool("json", false, "print the endpoints as JSON")
	providers := fs.String("providers-config", "", "modelproxy's providers file (docs/providers.md); default $CURFEW_PROVIDERS_CONFIG, else only the sim model")
	admissionFile := fs.String("admission-config", "", "admission file: pools, tenant limits, token budgets (docs/admission.md), for the orchestrator's admission and modelproxy's per-call budget reservations; default $CURFEW_ADMISSION_CONFIG, else the built-in pools")
	toolsFile := fs.String("tools-config", "", "toolrunner's tool sources file: MCP and ToolService servers (docs/tools.md); default $CURFEW_TOOLS_CONFIG, else the built-in tools only")
	storeDSN := fs.String("store", "", "the durable store: a postgres:// DSN, or a SQLite path (default: curfew.db in --data-dir)")
	insecureFlag := fs.Bool("insecure", false, "run the services plaintext, without mTLS: only for local debugging (default: a local CA and per-service certificates in --data-dir/tls, re-issued at each start)")
	if _, err := parse(fs, args); err != nil {
		return usageErr(stderr, "up", err)
	}
	extra := map[string][]string{} // extra flags per service
	if *providers != "" {
		abs, err := filepath.Abs(*providers)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--providers-config: %w", err))
		}
		extra["modelproxy"] = append(extra["modelproxy"], "--providers-config", abs)
	}
	if *admissionFile != "" {
		abs, err := filepath.Abs(*admissionFile)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--admission-config: %w", err))
		}
		extra["orchestrator"] = append(extra["orchestrator"], "--admission-config", abs)
		// modelproxy reads the same file's token budgets for its per-call reservations.
		extra["modelproxy"] = append(extra["modelproxy"], "--admission-config", abs)
	}
	if *toolsFile != "" {
		abs, err := filepath.Abs(*toolsFile)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--tools-config: %w", err))
		}
		extra["toolrunner"] = append(extra["toolrunner"], "--tools-config", abs)
	}
	dsn := *storeDSN
	if dsn == "" {
		abs, err := filepath.Abs(filepath.Join(*dataDir, "curfew.db"))
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--data-dir: %w", err))
		}
		dsn = "sqlite://" + abs
	}
	if *grace <= 0 {
		return usageErr(stderr, "up", fmt.Errorf("--shutdown-grace must be positive, got %v", *grace))
	}
	for _, svc := range launch.Services {
		extra[svc] = append(extra[svc], "--shutdown-grace", grace.String())
	}
	// A service stops within its drain delay (CURFEW_DRAIN_DELAY, which it inherits; 0 by
	// default) + --shutdown-grace + service.StopFlush; it is killed only a second after that.
	killAfter := *grace + service.StopFlush + time.Second
	if d, err := time.ParseDuration(os.Getenv(service.EnvName("drain-delay"))); err == nil && d > 0 {
		killAfter += d
	}
	for _, svc := range []string{"toolrunner", "orchestrator", "modelproxy"} { // the services that keep durable state
		extra[svc] = append(extra[svc], "--store", dsn)
	}
	if *storeDSN == "" {
		// The store in --data-dir is this mesh's alone, and it has one replica of each
		// service: no replica to share the admission caps, the retry windows or the
		// breakers' probes with, so none of them is claimed in the store (docs/cluster.md).
		// A --store given may be shared with another mesh.
		extra["orchestrator"] = append(extra["orchestrator"], "--cluster-admission=false")
		for _, svc := range []string{"toolrunner", "orchestrator", "modelproxy"} {
			extra[svc] = append(extra[svc], "--retry-coordination=off", "--breaker-coordination=off")
		}
	}
	if *basePort < 0 || *basePort > 65535-9 {
		return usageErr(stderr, "up", fmt.Errorf("--base-port must be 0 or between 1 and %d", 65535-9))
	}
	if err := os.MkdirAll(filepath.Join(*dataDir, "logs"), 0o755); err != nil { //nolint:gosec // the user's own logs, which hold no secrets
		return usageErr(stderr, "up", fmt.Errorf("--data-dir: %w", err))
	}
	tlsDir := ""
	if *insecureFlag {
		fmt.Fprintln(stderr, insecureWarning)
		for _, svc := range launch.Services {
			extra[svc] = append(extra[svc], "--insecure")
		}
	} else {
		var err error
		if tlsDir, err = launch.PrepareTLS(filepath.Join(*dataDir, launch.TLSSubdir)); err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--data-dir: mTLS certificates: %w", err))
		}
		for _, svc := range launch.Services {
			extra[svc] = append(extra[svc], "--tls-dir", tlsDir)
		}
	}
	// Open the store once before the services do: three processes creating and migrating
	// a new SQLite file at the same instant can fail to switch it to WAL (that needs the
	// file to themselves), and a bad DSN is better reported here than by three services.
	if err := prepareStore(ctx, dsn); err != nil {
		return usageErr(stderr, "up", fmt.Errorf("--store: %w", err))
	}
	// The web console (docs/console.md): its sessions' secret is kept in the data
	// directory, so that sessions outlive a restart; each start makes a new one-time
	// sign-in link for the local operator.
	signinToken, err := prepareConsole(*dataDir)
	if err != nil {
		return usageErr(stderr, "up", fmt.Errorf("--data-dir: the console's secret: %w", err))
	}
	extra["orchestrator"] = append(extra["orchestrator"], "--console-secret-file", filepath.Join(*dataDir, consoleSecretFile),
		"--console-signin-token-file", filepath.Join(*dataDir, consoleTokenFile))
	if *insecureFlag { // no mTLS, so the CLI is no mesh peer: it needs an API key
		if err := prepareCLIKey(ctx, dsn, *dataDir); err != nil {
			return usageErr(stderr, "up", fmt.Errorf("the CLI's API key: %w", err))
		}
	}
	bins, err := launch.FindBinaries(*binDir)
	if err != nil {
		return usageErr(stderr, "up", err)
	}
	eps, err := launch.Allocate(*basePort)
	if err != nil {
		fmt.Fprintln(stderr, "curfew up:", err)
		return ExitFail
	}

	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	logs := filepath.Join(*dataDir, "logs")
	m, err := launch.Start(launch.Config{Bins: bins, Endpoints: eps, LogDir: logs, TLSDir: tlsDir, Args: extra,
		StopGrace: killAfter, Log: fs.logger()})
	if err != nil {
		fmt.Fprintln(stderr, "curfew up:", err)
		return ExitFail
	}
	if err := m.WaitServing(ctx, *startTimeout); err != nil {
		fmt.Fprintln(stderr, "curfew up:", err, "(see", logs+")")
		m.Stop()
		return ExitFail
	}
	out := Endpoints{Services: m.Endpoints(), StartedAt: time.Now().UTC(), TLSDir: tlsDir}
	if err := writeEndpoints(*dataDir, out); err != nil {
		fmt.Fprintln(stderr, "curfew up:", err)
		m.Stop()
		return ExitFail
	}
	if *asJSON {
		c, _ := json.Marshal(out)
		fmt.Fprintln(stdout, string(c))
		fmt.Fprintln(stdout, `{"ready":true}`)
	} else {
		procs := m.Processes()
		for i := len(procs) - 1; i >= 0; i-- {
			p := procs[i]
			fmt.Fprintf(stdout, "%-13s %-21s admin http://%s  pid %d\n", p.Name, p.Addr, p.AdminAddr, p.PID())
		}
		for _, p := range procs {
			if p.OpenAIAddr != "" {
				fmt.Fprintf(stdout, "openai        http://%s/v1 (docs/openai.md)\n", p.OpenAIAddr)
			}
			if p.ConsoleAddr != "" {
				fmt.Fprintf(stdout, "console       http://%s/ (sign in once with http://%s/signin/link?token=%s)\n", p.ConsoleAddr, p.ConsoleAddr, signinToken)
			}
		}
		fmt.Fprintf(stdout, "endpoints     %s\nlogs          %s\n", filepath.Join(*dataDir, EndpointsFile), logs)
		if tlsDir != "" {
			fmt.Fprintf(stdout, "mtls          %s\n", tlsDir)
		} else {
			fmt.Fprintln(stdout, "mtls          off (--insecure)")
		}
		fmt.Fprintln(stdout, "ready")
	}

	exit := ExitOK
	if *maxRestarts <= 0 {
		if p := m.Wait(ctx); p != nil {
			fmt.Fprintf(stderr, "curfew up: %s exited unexpectedly: %v; stopping the mesh\n", p.Name, p.Err())
			exit = ExitFail
		}
	} else {
		// Keep the mesh up: a crashed service comes back on its addresses, and runs carry
		// on through the durable-state rules (docs/store.md).
		report := func(e launch.Event) {
			fmt.Fprintln(stderr, "curfew up:", e)
			if e.Kind == launch.Restarted {
				if out.Restarts == nil {
					out.Restarts = map[string]int{}
				}
				out.Restarts[e.Service] = e.Restarts
				out.Services = m.Endpoints() // its new pid
				if err := writeEndpoints(*dataDir, out); err != nil {
					fmt.Fprintln(stderr, "curfew up:", err)
				}
			}
		}
		if err := m.Supervise(ctx, launch.RestartPolicy{MaxRestarts: *maxRestarts}, report); err != nil {
			fmt.Fprintf(stderr, "curfew up: %v; stopping the mesh\n", err)
			exit = ExitFail
		}
	}
	m.Stop()
	_ = os.Remove(filepath.Join(*dataDir, EndpointsFile))
	if exit == ExitOK && !*asJSON {
		fmt.Fprintln(stdout, "stopped")
	}
	return exit
}
