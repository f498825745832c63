// Command orchestrator serves curfew.orchestrator.v1.OrchestratorService, curfew's public
// entry point. It only wires; the logic is in internal/orchestrator.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/orchestrator"
	"google.golang.org/grpc"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("orchestrator", flag.ContinueOnError)
	var o service.Options
	o.Register(fs, "orchestrator", "127.0.0.1:7700", "127.0.0.1:7701")
	modelAddr := fs.String("modelproxy", "127.0.0.1:7706", "modelproxy address")
	toolAddr := fs.String("toolrunner", "127.0.0.1:7702", "toolrunner address")
	subAddr := fs.String("subagent", "127.0.0.1:7704", "subagent address (read for run summaries)")
	model := fs.String("model", agent.DefaultModel, "model of runs that name none")
	maxRuns := fs.Int("max-runs", orchestrator.DefaultMaxRuns, "runs kept in memory; the oldest ended ones are forgotten first")
	minRun := fs.Duration("min-run-time", orchestrator.DefaultMinRunTime, "least time left to admit a run; less fails fast with DEADLINE_EXCEEDED")
	logPrompts := fs.Bool("log-prompts", false, "log each run's task (its prompt) when it starts; off by default, since tasks may hold private data")
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	if err := o.Validate(); err != nil { // a bad common flag is a usage error too
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	if *maxRuns < 1 || *minRun < 0 {
		fmt.Fprintln(os.Stderr, "orchestrator: --max-runs must be at least 1 and --min-run-time not negative")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rt, err := service.New(ctx, o, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 1
	}
	conns := map[string]string{"--modelproxy": *modelAddr, "--toolrunner": *toolAddr, "--subagent": *subAddr}
	cc := map[string]*grpcConn{}
	for flagName, addr := range conns {
		c, err := rt.Dial(strings.TrimPrefix(flagName, "--"), addr)
		if err != nil {
			fmt.Fprintf(os.Stderr, "orchestrator: %s: %v\n", flagName, err)
			return 2
		}
		defer c.Close()
		cc[flagName] = c
	}
	mc, tc, sc := cc["--modelproxy"], cc["--toolrunner"], cc["--subagent"]
	srv := orchestrator.New(orchestrator.Config{
		Loop: agent.Config{
			Model:      modelproxyv1.NewModelProxyServiceClient(mc),
			ModelNodes: meshv1.NewNodeReportServiceClient(mc),
			Tools:      toolrunnerv1.NewToolRunnerServiceClient(tc),
			ToolNodes:  meshv1.NewNodeReportServiceClient(tc),
			ModelName:  *model,
		},
		Reports: []meshv1.NodeReportServiceClient{
			meshv1.NewNodeReportServiceClient(mc), meshv1.NewNodeReportServiceClient(tc), meshv1.NewNodeReportServiceClient(sc),
		},
		MaxRuns:    *maxRuns,
		MinRunTime: *minRun,
		Log:        rt.Log,
		LogPrompts: *logPrompts,
	})
	orchestratorv1.RegisterOrchestratorServiceServer(rt.Server, srv)
	go service.Every(ctx, time.Minute, srv.Sweep)
	// Detached runs outlive the server's calls: they end once the server has stopped, and
	// before the runtime flushes their spans.
	rt.OnStop(func() { srv.Shutdown(o.ShutdownGrace) })
	err = rt.Serve(ctx)
	if err != nil {
		rt.Log.Error("serve", "error", err.Error())
		return 1
	}
	return 0
}

type grpcConn = grpc.ClientConn
