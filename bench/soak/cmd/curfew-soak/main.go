// Command curfew-soak drives a curfew mesh under load and writes what it found
// (docs/soak.md): report.json, summary.txt and PNG plots in --out. By default it starts
// its own mesh under `curfew up` (built from this repository, every service with
// --pprof, toolrunner with the MCP test server as tool source "fx"); with --data-dir it
// drives the mesh a running `curfew up` serves from that directory instead.
//
//	go run ./bench/soak/cmd/curfew-soak --concurrency 200 --duration 60s --out /tmp/soak
//
// It exits 0 when every check of the report held, 1 when one did not, 2 on bad usage.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/curfew-mesh/curfew/bench/soak"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/pgproc"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("curfew-soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mix := soak.DefaultMix()
	concurrency := fs.Int("concurrency", soak.DefaultConcurrency, "runs kept in flight (the offered load: a closed loop)")
	duration := fs.Duration("duration", time.Minute, "how long new runs start; the runs in flight then finish")
	settle := fs.Duration("settle", soak.DefaultSettle, "how long the processes get after the last run to return to their baseline")
	warmup := fs.Duration("warmup", soak.DefaultWarmup, "a load of the same mix before the measured one, so the baseline has the connections and caches a serving mesh keeps; 0 skips it")
	ramp := fs.Duration("ramp", soak.DefaultRamp, "spread the workers' first runs over this long, in the warm-up and the load; 0 starts them all at once")
	profile := fs.Duration("profile", 0, "take a CPU profile of this long and an allocation profile of every process from the load's middle, into --out/profiles (the processes need --pprof, which the own mesh has)")
	tokensAfterCancel := fs.Int64("max-tokens-after-cancel", soak.DefaultTokensAfterCancel, "the most tokens a decoder may decode after its run's cancel (issue 26's bound is 1)")
	rounds := fs.Int("rounds", 1, "loads run one after the other on the same mesh; with 2 or more, the last one's heap after a forced collection must end within 10 % of the first's (a plateau, not a leak)")
	pgRestart := fs.Bool("pg-restart", false, "run the own mesh on a PostgreSQL of its own (initdb, pg_ctl) and restart it once during each load, down for 3 s, and check afterwards that, per modelproxy process running then, the ledger holds every token it emitted")
	kill := fs.Bool("kill", false, "SIGKILL each service once during each load (modelproxy, toolrunner, subagent, orchestrator, evenly spread); curfew up must restart every one, and no run may be lost (the own mesh only)")
	cluster := fs.Bool("cluster", false, "instead of curfew up, two replicas of every service, each behind a toxiproxy proxy on its own 127.0.0.x, on a PostgreSQL of its own (initdb, pg_ctl); with --kill one replica of each service is killed and restarted after 3 s")
	toxics := fs.Bool("toxics", false, "with --cluster: latency, TCP resets and a black hole switched on and off on the replicas' hops during each load (docs/soak.md)")
	seed := fs.Uint64("seed", 0, "seed of the draws of kinds and cancel instants (0: random, reported)")
	out := fs.String("out", "soak-report", "directory for report.json, summary.txt and the plots")
	dataDir := fs.String("data-dir", "", "drive the mesh a running `curfew up` serves from this directory (its endpoints.json) instead of starting one; the MCP kind then needs --mcp-tool")
	mcpTool := fs.String("mcp-tool", "", "the MCP effect tool as plans call it, with --data-dir (the own mesh's is fx__effect)")
	weights := fs.String("weights", weightsString(mix.Weights), "the mix: kind=weight, comma-separated (kinds: tools, mcp, subagent, failing, cancelled, deadline)")
	fs.DurationVar(&mix.CancelMin, "cancel-min", mix.CancelMin, "earliest client cancel of a cancelled run after its start")
	fs.DurationVar(&mix.CancelMax, "cancel-max", mix.CancelMax, "latest client cancel of a cancelled run after its start")
	fs.IntVar(&mix.StepTokens, "step-tokens", mix.StepTokens, "tokens of each model step of the short kinds")
	fs.Float64Var(&mix.TokensPerSecond, "tokens-per-second", mix.TokensPerSecond, "decode rate of the short kinds' model steps")
	fs.Float64Var(&mix.LongTokensPerSecond, "long-tokens-per-second", mix.LongTokensPerSecond, "decode rate of the cancelled and deadline kinds' long decodes")
	fs.DurationVar(&mix.DeadlineTimeout, "deadline", mix.DeadlineTimeout, "the deadline kind's timeout")
	fs.IntVar(&mix.ToolMS, "tool-ms", mix.ToolMS, "duration of the tools kind's sleep tool, in milliseconds")
	fs.Float64Var(&mix.ToolFailRate, "tool-fail-rate", mix.ToolFailRate, "share of tools runs that also call the failing tool")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if (*kill || *pgRestart || *cluster) && *dataDir != "" {
		fmt.Fprintln(stderr, "curfew-soak: --kill, --pg-restart and --cluster need the own mesh (no --data-dir)")
		return 2
	}
	if *toxics && !*cluster {
		fmt.Fprintln(stderr, "curfew-soak: --toxics needs --cluster (toxiproxy stands in front of the cluster's replicas)")
		return 2
	}
	w, err := parseWeights(*weights)
	if err != nil {
		fmt.Fprintln(stderr, "curfew-soak: --weights:", err)
		return 2
	}
	mix.Weights = w
	if err := os.MkdirAll(*out, 0o755); err != nil { //nolint:gosec // a report directory for people to read
		fmt.Fprintln(stderr, "curfew-soak:", err)
		return 1
	}

	var pg *pgproc.Server
	if *pgRestart || *cluster {
		if pg, err = pgproc.Start(ctx); err != nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			return 1
		}
		defer func() { _ = pg.Close() }()
	}
	t, err := target(ctx, *out, *dataDir, *concurrency, *cluster, pg, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "curfew-soak:", err)
		return 1
	}
	defer func() { _ = t.close() }()
	mix.MCPTool = soak.MCPTool
	if *dataDir != "" {
		mix.MCPTool = *mcpTool
	}
	if mix.MCPTool != "" {
		if err := soak.WaitForTool(ctx, t.orchs[0], mix.MCPTool); err != nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			return 1
		}
	}
	cfg := soak.Config{Orchestrators: t.orchs, Concurrency: *concurrency,
		Duration: *duration, Mix: mix, Seed: *seed, Settle: *settle, Log: stderr, Warmup: *warmup}
	if *warmup == 0 {
		cfg.Warmup = -1
	}
	cfg.Ramp = *ramp
	cfg.TokensAfterCancel = *tokensAfterCancel
	if *ramp == 0 {
		cfg.Ramp = -1
	}
	if *profile > 0 {
		cfg.ProfileDir, cfg.ProfileFor = filepath.Join(*out, "profiles"), *profile
	}
	cfg.Processes, cfg.GoroutineSlack = t.processes, t.slack
	if t.record != "" {
		cfg.Effects = func() (soak.Effects, error) { return soak.EffectsFromRecord(t.record) }
	}
	ok := true
	var reports []*soak.Report
	for round := 1; round <= *rounds; round++ {
		dir := *out
		if *rounds > 1 {
			dir = filepath.Join(*out, fmt.Sprintf("round-%d", round))
			if cfg.ProfileDir != "" {
				cfg.ProfileDir = filepath.Join(dir, "profiles")
			}
			fmt.Fprintf(stdout, "== round %d of %d\n", round, *rounds)
		}
		faults, after, err := t.faults(*duration, *kill, *toxics)
		if err != nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			return 1
		}
		cfg.Faults = faults
		if *pgRestart {
			cfg.Faults = append(cfg.Faults, soak.RestartStore(pg, *duration*3/10))
		}
		cfg.DumpDir = filepath.Join(dir, "goroutines")
		rep, err := soak.Drive(ctx, cfg)
		if rep != nil {
			rep.Checks = append(rep.Checks, after(ctx)...)
		}
		if rep != nil && *pgRestart {
			rep.Checks = append(rep.Checks, soak.LedgerGap(ctx, pg.DSN(), t.modelproxies...))
		}
		if rep == nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			return 1
		}
		if err != nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			ok = false
		}
		if err := write(rep, dir, stdout); err != nil {
			fmt.Fprintln(stderr, "curfew-soak:", err)
			return 1
		}
		ok = ok && rep.OK()
		reports = append(reports, rep)
	}
	if len(reports) > 1 {
		checks := soak.Plateau(reports[0], reports[len(reports)-1])
		for _, c := range checks {
			mark := "ok  "
			if !c.OK {
				mark, ok = "FAIL", false
			}
			fmt.Fprintf(stdout, "%s %s: %s\n", mark, c.Name, c.Detail)
		}
	}
	if !ok {
		return 1
	}
	return 0
}

// mesh is the mesh a soak drives: its own under curfew up, its own cluster, or a running
// curfew up's.
type mesh struct {
	orchs        []orchestratorv1.OrchestratorServiceClient
	processes    []soak.Process
	modelproxies []soak.Process
	record       string // the MCP server's record of calls; "" when not the own mesh
	slack        int    // the goroutine check's (0: the default)
	// faults are a load's kills and toxics, and after checks what they left.
	faults func(d time.Duration, kill, toxics bool) ([]soak.Fault, func(context.Context) []soak.Check, error)
	close  func() error
}

// target starts the mesh the flags ask for, or attaches to the running one in dataDir.
func target(ctx context.Context, out, dataDir string, concurrency int, cluster bool, pg *pgproc.Server, stderr io.Writer) (*mesh, error) {
	if cluster {
		c, err := soak.StartCluster(ctx, filepath.Join(out, "mesh"), concurrency, pg.DSN())
		if err != nil {
			return nil, err
		}
		orchs, err := c.Orchestrators()
		if err != nil {
			_ = c.Close()
			return nil, err
		}
		t := &mesh{orchs: orchs, processes: c.Processes(), record: c.Record, close: c.Close, slack: soak.ClusterGoroutineSlack}
		for _, p := range t.processes {
			if strings.HasPrefix(p.Name, "modelproxy") {
				t.modelproxies = append(t.modelproxies, p)
			}
		}
		t.faults = func(d time.Duration, kill, toxics bool) ([]soak.Fault, func(context.Context) []soak.Check, error) {
			return c.Faults(d, kill, toxics), func(ctx context.Context) []soak.Check {
				return append(c.Serving(ctx), c.ModelproxyNotFenced(ctx)...)
			}, nil
		}
		return t, nil
	}
	var (
		m      *meshproc.Mesh
		record string
		err    error
	)
	if dataDir != "" {
		m, err = meshproc.Attach(dataDir)
	} else {
		dsn := ""
		if pg != nil {
			dsn = pg.DSN()
		}
		m, record, err = soak.StartMesh(ctx, filepath.Join(out, "mesh"), concurrency, dsn, stderr)
	}
	if err != nil {
		return nil, err
	}
	orch, err := m.Orchestrator()
	if err != nil {
		_ = m.Stop()
		return nil, err
	}
	t := &mesh{orchs: []orchestratorv1.OrchestratorServiceClient{orch}, processes: soak.Processes(m), record: record, close: m.Stop,
		modelproxies: []soak.Process{{Name: "modelproxy", Admin: m.Endpoints.Services["modelproxy"].AdminAddr}}}
	t.faults = func(d time.Duration, kill, _ bool) ([]soak.Fault, func(context.Context) []soak.Check, error) {
		if !kill {
			return nil, func(context.Context) []soak.Check { return nil }, nil
		}
		before, err := soak.ReadState(m.Dir)
		if err != nil {
			return nil, nil, err
		}
		return soak.Kills(m, d), func(ctx context.Context) []soak.Check { return soak.MeshUp(ctx, m, before, soak.KillOrder) }, nil
	}
	return t, nil
}

// write writes rep's report.json, summary.txt and plots into dir, and its summary to w.
func write(rep *soak.Report, dir string, w io.Writer) error {
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // a report directory for people to read
		return err
	}
	if err := rep.WriteJSON(filepath.Join(dir, "report.json")); err != nil {
		return err
	}
	if _, err := rep.Plots(dir); err != nil {
		return err
	}
	summary := rep.Summary()
	if err := os.WriteFile(filepath.Join(dir, "summary.txt"), []byte(summary), 0o644); err != nil { //nolint:gosec // for people to read
		return err
	}
	_, err := fmt.Fprint(w, summary)
	return err
}

func weightsString(w map[soak.Kind]int) string {
	parts := make([]string, 0, len(w))
	for k, v := range w {
		parts = append(parts, fmt.Sprintf("%s=%d", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ",")
}

func parseWeights(s string) (map[soak.Kind]int, error) {
	w := map[soak.Kind]int{}
	for _, part := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return nil, fmt.Errorf("%q: want kind=weight", part)
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%q: the weight is a whole number ≥ 0", part)
		}
		w[soak.Kind(k)] = n
	}
	return w, nil
}
