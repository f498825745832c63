// Command modelproxy serves curfew.modelproxy.v1.ModelProxyService: the built-in `sim`
// decoder, OpenAI-compatible providers behind fallback chains and breakers, and its
// token ledger, persisted with --store. It only wires; the logic is in
// internal/modelproxy, and the drill's faults, wired under --chaos, in internal/chaos.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/configwatch"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/chaos"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/modelproxy"
)

// ledgerFlushBound bounds the wait at exit for the token ledger's last entries to reach
// the store (retried meanwhile if the store fails); what it cannot take by then is
// logged as lost.
const ledgerFlushBound = 5 * time.Second

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("modelproxy", flag.ContinueOnError)
	var o service.Options
	o.Register(fs, "modelproxy", "127.0.0.1:7706", "127.0.0.1:7707")
	minDecode := fs.Duration("min-decode-time", 50*time.Millisecond, "least time left to start a decoder; less fails fast with DEADLINE_EXCEEDED")
	providers := fs.String("providers-config", "", "JSON file of OpenAI-compatible providers and model aliases (see docs/providers.md); only the built-in sim model when empty")
	leaseTTL := fs.Duration("decoder-lease-ttl", modelproxy.DefaultLeaseTTL, "TTL of a decoder's lease when its caller names none (GenerateRequest.lease_ttl): a decoder whose caller has not renewed its lease (RenewLeases) for this long stops by itself, cause lease_expired (see docs/leases.md); 0 gives such decoders no lease")
	admissionFile := fs.String("admission-config", "", "the orchestrator's admission file (docs/admission.md), read for its tenants' token budgets: each model call reserves its prompt and max_tokens against its tenant's budget before it starts and is refused RESOURCE_EXHAUSTED when the budget cannot cover it; counted across every modelproxy replica sharing a --store (SQLite file or PostgreSQL; docs/cluster.md), in this replica alone without one; no reservations when empty or no tenant has a budget")
	storeDSN := fs.String("store", "", "durable store of the token ledger: a SQLite path (sqlite:///path/curfew.db) or a postgres:// DSN; `curfew up` passes one under its data directory; without one the ledger is kept in memory only and a run's spend does not survive a restart")
	controlsPoll := fs.Duration("controls-poll", modelproxy.DefaultControlsPoll, "how often the operators' controls are read from the store (ledger freezes, decoder drains: see docs/operations.md); at most 1s, so that a freeze or drain holds on every replica within a second")
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy:", err)
		return 2
	}
	if err := o.Validate(); err != nil { // a bad common flag is a usage error too
		fmt.Fprintln(os.Stderr, "modelproxy:", err)
		return 2
	}
	if *minDecode < 0 {
		fmt.Fprintln(os.Stderr, "modelproxy: --min-decode-time must not be negative")
		return 2
	}
	if err := modelproxy.ValidateControlsPoll(*controlsPoll); err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy: --controls-poll:", err)
		return 2
	}
	if err := modelproxy.ValidateLeaseTTL(*leaseTTL); err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy: --decoder-lease-ttl:", err)
		return 2
	}
	var (
		file *modelproxy.File
		err  error
	)
	if *providers != "" {
		f, err := modelproxy.LoadFile(*providers)
		if err != nil {
			fmt.Fprintln(os.Stderr, "modelproxy: --providers-config:", err)
			return 2
		}
		file = f
	}
	var limits admission.Config // no budgets
	if *admissionFile != "" {
		if limits, err = admission.Load(*admissionFile); err != nil {
			fmt.Fprintln(os.Stderr, "modelproxy: --admission-config:", err)
			return 2
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Without --store a private memory store stands in; a private store is not written (the
	// in-memory Ledger serves the summaries), so the ledger lives no longer than the process.
	st, err := memory.OpenOr(ctx, *storeDSN, "modelproxy")
	if err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy: --store:", err)
		return 2
	}
	defer func() { _ = st.Close() }()
	rt, err := service.New(ctx, o, map[string]time.Duration{
		modelproxyv1.ModelProxyService_Generate_FullMethodName: *minDecode,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy:", err)
		return 1
	}
	srv := modelproxy.New(st)
	defer func() { // the last decoders' entries, before the store closes
		fctx, cancel := context.WithTimeout(context.Background(), ledgerFlushBound)
		defer cancel()
		if err := srv.Flush(fctx); err != nil {
			rt.Log.Error("modelproxy: at exit", "error", err.Error())
		}
	}()
	srv.Nodes = nodes.New(rt.Opts.Retention)
	srv.Metrics = modelproxy.NewMetrics(rt.Registry)
	rt.Registry.MustRegister(srv.LedgerWriterCollector())
	srv.Log = rt.Log
	srv.Leases.TTL = *leaseTTL
	srv.Replica = rt.Replica()
	// The metrics exist at 0 with or without budgets; reservations only with one at start
	// (a reservation also bounds a call's max_tokens, which a file without budgets must
	// not do), so a reload changes budgets but does not add the first one.
	// A shared store shares the budgets: every replica reserves against it
	// (docs/cluster.md, "Budgets across replicas"); a private one counts in memory.
	live := admission.NewLiveLimits(limits)
	switch {
	case st.Shared() && hasBudget(limits):
		b, err := budget.NewShared(budget.SharedConfig{Store: st, Limits: live, Registry: rt.Registry, Logger: rt.Log,
			Replicas: liveReplicas(st, rt.Opts.Name, srv.Replica)})
		if err != nil {
			rt.Log.Error("token budgets", "error", err.Error())
			return 1
		}
		defer func() { _ = b.Close() }() // before the store closes
		srv.Budgets = b
	case st.Shared():
		budget.NewMemory(live, budget.Options{Registry: rt.Registry}) // the metrics, at 0
	default:
		if b := budget.NewMemory(live, budget.Options{Registry: rt.Registry}); hasBudget(limits) {
			srv.Budgets = b
		}
	}
	if *admissionFile != "" {
		// The tenants' budgets follow the file; reservations in flight settle as made.
		if _, err := service.WatchConfig(ctx, rt, configwatch.Config[admission.Config]{Name: "admission", Path: *admissionFile,
			Load:  func(b []byte) (admission.Config, error) { return admission.Decode(bytes.NewReader(b)) },
			Apply: live.Update}); err != nil {
			fmt.Fprintln(os.Stderr, "modelproxy: --admission-config:", err)
			return 2
		}
	}
	rt.RecordConfigs(ctx, st)
	rt.Registry.MustRegister(srv.Leases.Collector())
	if file != nil {
		if srv.Router, err = modelproxy.NewRouter(file, modelproxy.RouterOptions{Registry: rt.Registry, Log: rt.Log}); err != nil {
			fmt.Fprintln(os.Stderr, "modelproxy: --providers-config:", err)
			return 2
		}
		rt.Log.Info("providers configured", "models", srv.Router.Models())
		defer srv.Router.Close()
	}
	// With a shared store, one half-open probe per service and per provider across the
	// replicas.
	var providerBreakers *breaker.Set
	if srv.Router != nil {
		providerBreakers = srv.Router.Breakers()
	}
	if _, err := rt.CoordinateBreakers(ctx, st, providerBreakers); err != nil {
		fmt.Fprintln(os.Stderr, "modelproxy:", err)
		return 1
	}
	var svc modelproxyv1.ModelProxyServiceServer = srv
	if o.Chaos {
		svc = chaos.Wire(srv) // the drill's faults, sim model only
	}
	modelproxyv1.RegisterModelProxyServiceServer(rt.Server, svc)
	report := srv.Report()
	report.Metrics = nodes.NewMetrics(rt.Registry, meshv1.NodeKind_NODE_KIND_MODEL)
	meshv1.RegisterNodeReportServiceServer(rt.Server, report)
	go service.Every(ctx, rt.Opts.SweepEvery(), srv.Sweep)
	// The operators' freezes and drains, from the store: the shared one every replica
	// reads, or this replica's own.
	go srv.WatchControls(ctx, st, *controlsPoll)
	if err := rt.Serve(ctx); err != nil {
		rt.Log.Error("serve", "error", err.Error())
		return 1
	}
	return 0
}

// liveReplicas is the replica count of budget.SharedConfig: the replicas of service name
// seen recently in the store (service.LiveReplicas), among which a tenant's budget is
// shared while the store is unreachable.
func liveReplicas(st store.Replicas, name, self string) func(context.Context) (int, error) {
	return func(ctx context.Context) (int, error) { return service.LiveReplicas(ctx, st, name, self) }
}

// hasBudget reports whether any tenant of c, or its default, has a token budget.
func hasBudget(c admission.Config) bool {
	if c.DefaultTenant.TokenBudget > 0 {
		return true
	}
	for _, l := range c.Tenants {
		if l.TokenBudget > 0 {
			return true
		}
	}
	return false
}
