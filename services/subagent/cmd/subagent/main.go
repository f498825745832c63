// Command subagent serves curfew.subagent.v1.SubagentService: nested agent loops. It only
// wires; the logic is in internal/subagent and the shared loop in mesh/agent.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/hedge"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/services/subagent/internal/subagent"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("subagent", flag.ContinueOnError)
	var o service.Options
	o.Register(fs, "subagent", "127.0.0.1:7704", "127.0.0.1:7705")
	modelAddr := fs.String("modelproxy", "127.0.0.1:7706", "modelproxy address")
	toolAddr := fs.String("toolrunner", "127.0.0.1:7702", "toolrunner address")
	model := fs.String("model", agent.DefaultModel, "model of nested loops when the caller names none")
	minSpawn := fs.Duration("min-spawn-time", 100*time.Millisecond, "least time left to start a subagent; less fails fast with DEADLINE_EXCEEDED")
	maxDepth := fs.Int("max-depth", subagent.DefaultMaxDepth, "deepest subagent nesting served")
	var hedging hedge.Flags
	hedging.Register(fs)
	decoderFile := fs.String("decoder-config", "", `JSON file of the decoder-lease heartbeat and TTL, {"heartbeat": "4s", "lease_ttl": "12s"} (docs/leases.md), reloaded when it changes and on SIGHUP; default: a 4s heartbeat and a 12s TTL`)
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "subagent:", err)
		return 2
	}
	if err := o.Validate(); err != nil { // a bad common flag is a usage error too
		fmt.Fprintln(os.Stderr, "subagent:", err)
		return 2
	}
	if err := hedging.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --hedge-max-extra-load:", err)
		return 2
	}
	if *minSpawn < 0 || *maxDepth < 1 {
		fmt.Fprintln(os.Stderr, "subagent: --min-spawn-time must not be negative and --max-depth must be at least 1")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rt, err := service.New(ctx, o, map[string]time.Duration{subagentv1.SubagentService_Spawn_FullMethodName: *minSpawn})
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent:", err)
		return 1
	}
	mc, err := rt.Dial("modelproxy", *modelAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --modelproxy:", err)
		return 2
	}
	defer mc.Close()
	tc, err := rt.Dial("toolrunner", *toolAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --toolrunner:", err)
		return 2
	}
	defer tc.Close()
	// Node reports ask every replica of the service (package replicas): a cancelled
	// subtree's teardown is waited for on the replica that ran it.
	modelNodes, mcl, err := rt.NodeReports("modelproxy", *modelAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --modelproxy:", err)
		return 2
	}
	defer mcl.Close()
	toolNodes, tcl, err := rt.NodeReports("toolrunner", *toolAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --toolrunner:", err)
		return 2
	}
	defer tcl.Close()
	models := modelproxyv1.NewModelProxyServiceClient(mc)
	// The process-wide keeper of the model client renews the decoders' leases
	// (docs/leases.md); its warnings go to the service's log, and --decoder-config
	// changes its timing live.
	leases := decoderlease.Shared(models, decoderlease.Options{Log: rt.Log})
	if *decoderFile != "" {
		if err := service.WatchDecoder(ctx, rt, *decoderFile, leases); err != nil {
			fmt.Fprintln(os.Stderr, "subagent: --decoder-config:", err)
			return 2
		}
	}
	hedges, err := hedging.Policy(rt.Registry)
	if err != nil {
		fmt.Fprintln(os.Stderr, "subagent: --hedge-max-extra-load:", err)
		return 2
	}
	srv := subagent.New(subagent.Config{MaxDepth: *maxDepth, NodeRetention: rt.Opts.Retention, Loop: agent.Config{
		Model:      models,
		ModelNodes: modelNodes,
		Tools:      toolrunnerv1.NewToolRunnerServiceClient(tc),
		ToolNodes:  toolNodes,
		ModelName:  *model,
		Leases:     leases,
		Hedge:      hedges,
	}})
	subagentv1.RegisterSubagentServiceServer(rt.Server, srv)
	report := srv.Report()
	report.Metrics = nodes.NewMetrics(rt.Registry, meshv1.NodeKind_NODE_KIND_SUBAGENT)
	meshv1.RegisterNodeReportServiceServer(rt.Server, report)
	go service.Every(ctx, rt.Opts.SweepEvery(), srv.Nodes.Sweep)
	if err := rt.Serve(ctx); err != nil {
		rt.Log.Error("serve", "error", err.Error())
		return 1
	}
	return 0
}
