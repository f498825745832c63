package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/drill"
	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// cmdDrill is `curfew drill` (package drill): on its own mesh, or on the mesh of --addr
// or --data-dir; it prints one JSON row per task, then the VERDICT line.
func cmdDrill(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("drill", stderr)
	var c common
	c.register(fs)
	var cfg drill.Config
	fs.StringVar(&cfg.Mode, "mode", "shed", "shed (curfew's cancel path) or orphan (propagation switched off: the naive baseline)")
	fs.IntVar(&cfg.Fault, "fault", 0, "inject one of seed 003's faults, 1 to 5 (docs/drill.md); 0 none")
	fs.IntVar(&cfg.Tasks, "tasks", drill.DefaultTasks, "tasks, all sharing one deadline; the first 2 are critical (paid pool), the rest sheddable (overflow)")
	fs.DurationVar(&cfg.Deadline, "deadline", drill.DefaultDeadline, "the tasks' shared deadline")
	fs.DurationVar(&cfg.CancelAt, "cancel-at", drill.DefaultCancelAt, "when the client cancels every task")
	fs.Float64Var(&cfg.TPS, "tps", drill.DefaultTPS, "decode rate, tokens per second")
	fs.DurationVar(&cfg.Heartbeat, "heartbeat", drill.DefaultHeartbeat, "decoder lease heartbeat period")
	fs.DurationVar(&cfg.LeaseTTL, "lease-ttl", 0, "decoder lease TTL; default 2 × --heartbeat, so that a lapse can come before the deadline (docs/drill.md)")
	fs.DurationVar(&cfg.SlowHeartbeat, "slow-heartbeat", 0, "fault 2's heartbeat period; default --deadline/3 + 1s")
	binDir := fs.String("bin-dir", "", "directory of the service binaries for the drill's own mesh (default: next to curfew, else $PATH)")
	if _, err := parse(fs, args); err != nil {
		return usageErr(stderr, "drill", err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	cfg = cfg.WithDefaults()
	switch {
	case cfg.Mode != "shed" && cfg.Mode != "orphan":
		return usageErr(stderr, "drill", fmt.Errorf("--mode must be shed or orphan, got %q", cfg.Mode))
	case cfg.Fault < 0 || cfg.Fault > 5:
		return usageErr(stderr, "drill", fmt.Errorf("--fault must be 1 to 5, got %d", cfg.Fault))
	case cfg.Fault != 0 && cfg.Mode == "orphan":
		return usageErr(stderr, "drill", errors.New("--fault goes with --mode shed: one break at a time"))
	case cfg.Tasks < 1 || cfg.Tasks > 64:
		return usageErr(stderr, "drill", fmt.Errorf("--tasks must be 1 to 64, got %d", cfg.Tasks))
	case cfg.Deadline < time.Second || cfg.CancelAt <= 0 || cfg.CancelAt >= cfg.Deadline:
		return usageErr(stderr, "drill", errors.New("--deadline must be at least 1s and --cancel-at between 0 and the deadline"))
	case cfg.TPS <= 0 || cfg.TPS > 1000:
		return usageErr(stderr, "drill", fmt.Errorf("--tps must be in (0, 1000], got %v", cfg.TPS))
	case cfg.Heartbeat < 50*time.Millisecond || cfg.LeaseTTL < cfg.Heartbeat:
		return usageErr(stderr, "drill", errors.New("--heartbeat must be at least 50ms and --lease-ttl at least the heartbeat"))
	}
	var conn *grpc.ClientConn
	if set["addr"] || set["data-dir"] || c.addr != "" {
		// Another mesh: the client commands' connection, with its API key if any.
		var err error
		if conn, err = c.dial(); err != nil {
			return callErr(stderr, "drill", err)
		}
	} else {
		m, err := drill.StartMesh(ctx, cfg, *binDir, fs.logger())
		if err != nil {
			fmt.Fprintln(stderr, "curfew drill:", err)
			return ExitFail
		}
		defer m.Stop()
		creds, err := launch.ClientCredentials(m.TLSDir, meshtls.Orchestrator, fs.logger())
		if err != nil {
			return callErr(stderr, "drill", err)
		}
		if conn, err = grpc.NewClient(m.Addr, grpc.WithTransportCredentials(creds), withTracing()); err != nil {
			return callErr(stderr, "drill", err)
		}
	}
	defer conn.Close()
	rows, err := drill.Run(ctx, orchestratorv1.NewOrchestratorServiceClient(conn), cfg)
	if err != nil {
		fmt.Fprintf(stderr, "curfew drill: %v\n", err)
		return ExitFail
	}
	for _, r := range rows {
		b, _ := json.Marshal(r)
		fmt.Fprintln(stdout, string(b))
	}
	v, ok := drill.Verdict(cfg, rows)
	if !c.json {
		fmt.Fprintln(stdout, "VERDICT: "+v)
	}
	if !ok {
		return ExitFail
	}
	return ExitOK
}
