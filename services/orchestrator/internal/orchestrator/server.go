package orchestrator

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Config's zero fields.
const (
	DefaultMaxRuns    = 10000
	DefaultMinRunTime = 100 * time.Millisecond
	// DefaultLeaseTTL is Config.LeaseTTL's default.
	DefaultLeaseTTL = 10 * time.Second
	// RootNode is the id of every run's root node.
	RootNode = "root"
)

// RunStore is what the orchestrator keeps in its store: runs with their leases, and
// every run's checkpoints; and whether other orchestrators share it. A store.Store is
// one.
type RunStore interface {
	store.Runs
	store.Checkpoints
	store.Sharing
}

// Config configures a Server.
type Config struct {
	// Sheds, when set, receives the count of runs shed per tenant (FlushSheds), for
	// curfew usage.
	Sheds ShedCounter
	// Loop reaches modelproxy and toolrunner; its Emit and Notes are set per run.
	Loop agent.Config
	// Reports are the NodeReportServices of modelproxy, toolrunner and subagent, in that
	// order (reportModel, reportTool, reportSubagent), read to assemble summaries (of the
	// executors a run reached: reportSet) and told to cancel a run's nodes (all of them).
	// The first is modelproxy's, the decoders': a cancel tells it first (see cancelWith).
	Reports []meshv1.NodeReportServiceClient
	// NodeRetention is how long a run's node records stay in memory after it ended
	// (nodes.DefaultRetention when 0).
	NodeRetention time.Duration
	// MaxRuns is how many runs are kept in memory; DefaultMaxRuns when 0. Older ones
	// are read from a shared store; a process-private one forgets them too.
	MaxRuns int
	// MinRunTime is the least time left to admit a run; DefaultMinRunTime when 0.
	MinRunTime time.Duration
	// SettleTimeout bounds the wait for the tree's teardown when a run ends;
	// cancel.DefaultSettleTimeout when 0.
	SettleTimeout time.Duration
	Log           *slog.Logger
	// LogPrompts logs each run's task (its prompt) when it starts; off by default.
	LogPrompts bool
	// MaxRunTime caps a StartRun timeout; deadline.DefaultMax when 0.
	MaxRunTime time.Duration

	// Store records every run, leased to the orchestrator that advances it; required.
	// What it can do for a run depends on whether other orchestrators share it
	// (store.Sharing): on a shared store (SQLite file, PostgreSQL) every agent step is
	// checkpointed, and runs whose owner died or drained are resumed by another
	// orchestrator (leases.go); a process-private one (memory://) keeps the runs of this
	// process only, and a drain cancels them.
	Store RunStore
	// Owner names this process incarnation in run leases; a random name without an
	// address when "". Name it with OwnerName to give other orchestrators its address
	// for CancelRun and WatchRun forwarding.
	Owner string
	// Peers, when set, returns a client of the orchestrator at addr (an owner's address,
	// see OwnerName): a CancelRun of a run another orchestrator owns is forwarded to it
	// (cancelfwd.go), and a WatchRun of it is relayed from it (watchfwd.go). Without it
	// such a cancel reaches only the run's leaves and is kept for a takeover, and such a
	// watch is served from the store: the run's start and summary, no node events.
	Peers func(addr string) (orchestratorv1.OrchestratorServiceClient, error)
	// LeaseTTL is how long a run's lease lasts without a heartbeat; DefaultLeaseTTL when
	// 0. The owner heartbeats every third of it. A dead owner's runs are taken over
	// about LeaseTTL after its last heartbeat.
	LeaseTTL time.Duration
	// DeadLetters, when set, records runs that fail for good (mesh/dlq.Recorder).
	DeadLetters DeadLetterRecorder
	// Registerer, when set, receives the run-lease metrics of a shared store.
	Registerer prometheus.Registerer
	// Admission, when set, admits every new run (see admission.go); nil admits all.
	Admission *admission.Controller
}

// Server implements OrchestratorService.
type Server struct {
	orchestratorv1.UnimplementedOrchestratorServiceServer
	cfg   Config
	nodes *nodes.Table
	// sheds counts the runs shed per tenant until FlushSheds writes them.
	sheds shedCounts
	// shared is whether other orchestrators share the store (store.Sharing).
	shared bool

	mu    sync.Mutex
	runs  map[string]*run
	order []string // run ids, oldest first (sorted: UUIDv7)
	// startingRuns are the runs being recorded by a start, not yet in runs (creating),
	// each with the newer lease a takeover scan claimed it under meanwhile, or nil.
	startingRuns map[string]*store.Lease
	// drops are runs forgotten beyond MaxRuns still to be deleted from a private store;
	// dropping is whether dropForgotten is deleting them (run.go).
	drops    []runRef
	dropping bool
	wg       sync.WaitGroup
	// The lease loops of Start: heartbeats and takeovers, each stopped on its own.
	bg                          sync.WaitGroup
	stopHeartbeat, stopTakeover context.CancelFunc
	leaseMetrics                *leaseMetrics // nil on a private store or without a Registerer

	// The drain (drain.go): draining is set when it begins; the runs still here at
	// handoverAt are handed over (cancelled on a private store), and handedOver is
	// closed then.
	draining     atomic.Bool
	drainOnce    sync.Once
	drainBy      time.Time // the stop deadline the drain was given
	handoverAt   time.Time
	handedOver   chan struct{}
	handoverOnce sync.Once
	handovers    int // runs handed over (cancelled on a private store) at the handover point

	// cancels are the runs owned elsewhere whose CancelRun could not reach their owner,
	// with when: a takeover of one here ends it cancelled (cancelfwd.go).
	cancels map[string]time.Time
	// peers are the owners of runs in flight the store listed in the last peerMemory,
	// with when it last did: where a cancel goes while the store is down (peers.go).
	peers map[string]time.Time
}

// New returns a server. cfg.Store is required.
func New(cfg Config) *Server {
	if cfg.MaxRuns == 0 {
		cfg.MaxRuns = DefaultMaxRuns
	}
	if cfg.MinRunTime == 0 {
		cfg.MinRunTime = DefaultMinRunTime
	}
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = cancel.DefaultSettleTimeout
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.MaxRunTime == 0 {
		cfg.MaxRunTime = deadline.DefaultMax
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.Owner == "" {
		cfg.Owner = OwnerName("orchestrator/"+uuid.NewString()[:8], "")
	}
	s := &Server{cfg: cfg, nodes: nodes.New(cfg.NodeRetention), shared: cfg.Store.Shared(), runs: map[string]*run{}, startingRuns: map[string]*store.Lease{}, handedOver: make(chan struct{})}
	if s.shared && cfg.Registerer != nil {
		s.leaseMetrics = newLeaseMetrics(cfg.Registerer, s)
	}
	return s
}

// Wait blocks until every run's background work has finished.
func (s *Server) Wait() { s.wg.Wait() }

// Sweep forgets the node records of runs that ended long ago.
func (s *Server) Sweep(now time.Time) { s.nodes.Sweep(now) }
