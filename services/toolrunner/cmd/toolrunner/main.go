// Command toolrunner serves curfew.toolrunner.v1.ToolRunnerService: the built-in tools, and
// the tools of the sources --tools-config names.
// It only wires; the logic is in internal/toolrunner.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/google/uuid"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/configwatch"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/toolrunner"
)

// toolsReadyWait bounds how long toolrunner waits, at start, for its tool sources' first
// listing before it serves.
const toolsReadyWait = 10 * time.Second

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("toolrunner", flag.ContinueOnError)
	var o service.Options
	o.Register(fs, "toolrunner", "127.0.0.1:7702", "127.0.0.1:7703")
	subagentAddr := fs.String("subagent", "127.0.0.1:7704", "subagent service address (for spawn_subagent)")
	minTool := fs.Duration("min-tool-time", 10*time.Millisecond, "least time left to start a tool; less fails fast with DEADLINE_EXCEEDED")
	maxDepth := fs.Int("max-subagent-depth", toolrunner.DefaultMaxSubagentDepth, "deepest subagent nesting spawn_subagent may create")
	maxFanout := fs.Int("max-subagent-fanout", toolrunner.DefaultMaxSubagentFanout, "most subagents one run may have in flight on this process")
	toolsConfig := fs.String("tools-config", "", "tool sources file: MCP servers and ToolService servers whose tools toolrunner runs as source__tool (docs/tools.md); reloaded when it changes and on SIGHUP (a bad rewrite keeps the running sources); a bad file stops toolrunner at start")
	storeDSN := fs.String("store", "", "durable store of kv_put and notify: a SQLite path (sqlite:///path/curfew.db) or a postgres:// DSN; `curfew up` passes one under its data directory; without one those tools fail")
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner:", err)
		return 2
	}
	if err := o.Validate(); err != nil { // a bad common flag is a usage error too
		fmt.Fprintln(os.Stderr, "toolrunner:", err)
		return 2
	}
	switch {
	case *minTool < 0:
		fmt.Fprintln(os.Stderr, "toolrunner: --min-tool-time must not be negative")
		return 2
	case *maxDepth < 1 || *maxFanout < 1:
		fmt.Fprintln(os.Stderr, "toolrunner: --max-subagent-depth and --max-subagent-fanout must be at least 1")
		return 2
	}
	var tools *registry.Config
	if *toolsConfig != "" {
		c, err := registry.Load(*toolsConfig)
		if err != nil {
			fmt.Fprintln(os.Stderr, "toolrunner: --tools-config:", err)
			return 2
		}
		tools = c
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Without --store the store is private to this process, and kv_put and notify refuse it.
	st, err := memory.OpenOr(ctx, *storeDSN, "toolrunner")
	if err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner: --store:", err)
		return 2
	}
	defer func() { _ = st.Close() }()
	// The least time left to start, by method: a tool needs --min-tool-time; ListTools,
	// which answers from memory, needs none.
	rt, err := service.New(ctx, o, map[string]time.Duration{toolrunnerv1.ToolRunnerService_Execute_FullMethodName: *minTool})
	if err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner:", err)
		return 1
	}
	// On a shared store, at most the retry file's window.replicas toolrunners retry
	// calls to subagent at a time (docs/cluster.md).
	if err := rt.CoordinateRetries(st); err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner:", err)
		return 2
	}
	// With a shared store, one half-open probe per service across the replicas.
	if _, err := rt.CoordinateBreakers(ctx, st); err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner:", err)
		return 1
	}
	sc, err := rt.Dial("subagent", *subagentAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner: --subagent:", err)
		return 2
	}
	defer sc.Close()
	// Node reports ask every subagent replica (package replicas).
	subNodes, scl, err := rt.NodeReports("subagent", *subagentAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "toolrunner: --subagent:", err)
		return 2
	}
	defer scl.Close()
	cfg := toolrunner.Config{
		Subagent:          subagentv1.NewSubagentServiceClient(sc),
		SubagentNodes:     subNodes,
		MaxSubagentDepth:  *maxDepth,
		MaxSubagentFanout: *maxFanout,
		Registerer:        rt.Registry,
		Store:             st,
		Owner:             owner(),
	}
	if tools != nil {
		reg, err := registry.New(tools, registry.Options{Openers: openers(rt.ClientOptions), Registerer: rt.Registry, Logger: rt.Log})
		if err != nil {
			fmt.Fprintln(os.Stderr, "toolrunner: --tools-config:", err)
			return 2
		}
		defer func() { _ = reg.Close() }()
		cfg.Tools = reg
		// The sources follow the file (docs/tools.md, "Reloading the tools file"): unchanged
		// sources keep their sessions, removed or changed ones close after their calls.
		if _, err := service.WatchConfig(ctx, rt, configwatch.Config[*registry.Config]{Name: "tools", Path: *toolsConfig,
			Load:  func(b []byte) (*registry.Config, error) { return registry.Parse(b, os.LookupEnv, exec.LookPath) },
			Apply: reg.Update}); err != nil {
			fmt.Fprintln(os.Stderr, "toolrunner: --tools-config:", err)
			return 2
		}
		// Serve once every source has been tried: a run started as soon as the mesh is
		// ready then finds the tools of every source that is up. A source that is slow to
		// answer holds the start at most toolsReadyWait; it is then down until it answers.
		rctx, cancel := context.WithTimeout(ctx, toolsReadyWait)
		if err := reg.Ready(rctx); err != nil {
			rt.Log.Warn("serving before every tool source answered", "waited", toolsReadyWait.String())
		}
		cancel()
	}
	rt.RecordConfigs(ctx, st)
	cfg.NodeRetention = rt.Opts.Retention
	srv := toolrunner.New(cfg)
	toolrunnerv1.RegisterToolRunnerServiceServer(rt.Server, srv)
	report := srv.Report()
	report.Metrics = nodes.NewMetrics(rt.Registry, meshv1.NodeKind_NODE_KIND_TOOL)
	meshv1.RegisterNodeReportServiceServer(rt.Server, report)
	go service.Every(ctx, rt.Opts.SweepEvery(), srv.Sweep)
	if err := rt.Serve(ctx); err != nil {
		rt.Log.Error("serve", "error", err.Error())
		return 1
	}
	return 0
}

// owner names this process incarnation in the store's leases: host, pid and a random
// suffix, so a restarted toolrunner never mistakes its predecessor's records for its own.
func owner() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("toolrunner/%s/%d/%s", host, os.Getpid(), uuid.NewString()[:8])
}
