// Command orchestrator serves curfew.orchestrator.v1.OrchestratorService, curfew's public
// entry point. It only wires; the logic is in internal/orchestrator.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/clusterslots"
	"github.com/curfew-mesh/curfew/mesh/configwatch"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/dlq"
	"github.com/curfew-mesh/curfew/mesh/hedge"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/outbox"
	"github.com/curfew-mesh/curfew/mesh/replicas"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/admin"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/openaiapi"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/orchestrator"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
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
	storeDSN := fs.String("store", "", "durable store of runs, checkpoints, leases and dead letters: a SQLite path (sqlite:///path/curfew.db) or a postgres:// DSN; `curfew up` passes one under its data directory; without one, runs live in memory only and are lost with the process")
	advertise := fs.String("advertise-addr", "", "address other orchestrators reach this one at (with --store), named in its run leases so that a CancelRun or WatchRun received elsewhere reaches the run's owner; default: --addr when it names a host, else none (Kubernetes: $(POD_IP):port)")
	leaseTTL := fs.Duration("lease-ttl", orchestrator.DefaultLeaseTTL, "run lease TTL (with --store), and the outbox relay lease's (with --nats): heartbeats every third of it; a dead orchestrator's runs are taken over about this long after it died")
	natsURL := fs.String("nats", "", "NATS server (nats://host:4222) whose JetStream also receives dead letters (with --store); none by default")
	dlqStream := fs.String("dlq-stream", dlq.DefaultStream, "JetStream stream of dead letters (with --nats)")
	outboxStream := fs.String("outbox-stream", outbox.DefaultStream, "JetStream stream the outbox (notify) is relayed to (with --nats; docs/outbox.md): created if missing, covering <--outbox-subject-prefix>.>, else used as it is")
	outboxPrefix := fs.String("outbox-subject-prefix", outbox.DefaultSubjectPrefix, "subject prefix of the relayed outbox (with --nats): a tenant's channel is <prefix>.<tenant>.<channel>")
	outboxBatch := fs.Int("outbox-batch", outbox.DefaultBatch, "outbox rows the relay reads per batch (with --nats)")
	outboxInterval := fs.Duration("outbox-interval", outbox.DefaultInterval, "pause of the outbox relay after a batch that drained the outbox, and between tries to claim its lease (with --nats)")
	outboxRate := fs.Float64("outbox-rate", 0, "most outbox messages the relay publishes per second, sparing the stream's consumers a burst after an outage (with --nats); 0: no cap")
	admissionFile := fs.String("admission-config", "", "JSON file of admission pools, tenant limits and token budgets (docs/admission.md); default: a paid pool of 512 and an overflow pool of 128 runs, 50 run starts per second per tenant (burst 100)")
	heartbeat := fs.Duration("decoder-heartbeat", decoderlease.DefaultPeriod, "longest period between two renewals of a decoder's lease (docs/leases.md); each is renewed at least every third of its call's remaining deadline")
	decoderTTL := fs.Duration("decoder-lease-ttl", 0, "decoder lease TTL asked of modelproxy; default 3 × --decoder-heartbeat")
	decoderFile := fs.String("decoder-config", "", `JSON file of the decoder-lease heartbeat and TTL, {"heartbeat": "4s", "lease_ttl": "12s"} (docs/leases.md), reloaded when it changes and on SIGHUP; instead of --decoder-heartbeat and --decoder-lease-ttl`)
	openaiAddr := fs.String("openai-addr", "", "address of the OpenAI-compatible HTTP API (docs/openai.md): POST /v1/chat/completions and GET /v1/models, each completion a run; off unless set")
	openaiGrace := fs.Duration("openai-disconnect-grace", openaiapi.DefaultDisconnectGrace, "with --openai-addr: how long a run started with an Idempotency-Key waits, once its last client left, for a retry with the key to attach before it is cancelled (cause client_disconnect)")
	admissionOff := fs.Bool("admission-off", false, "admit every run at once: no pools, queue, budgets or shedding")
	clusterSlots := fs.Bool("cluster-admission", true, "with a shared --store, claim each admitted run's pool slot and tenant slot in the store, so that pool caps and tenant concurrency hold across every orchestrator replica (docs/cluster.md); false: each replica enforces them alone")
	clusterTTL := fs.Duration("cluster-slot-ttl", clusterslots.DefaultTTL, "TTL of a cluster-wide admission slot, renewed every third of it: a dead replica's slots return this long after its last renewal")
	clusterReplicas := fs.Int("cluster-replicas", 0, "orchestrator replicas sharing the caps, for each replica's share of a cap while the store is down (docs/cluster.md); 0: counted from the replicas' configuration rows in the store")
	var hedging hedge.Flags
	hedging.Register(fs)
	var consoleCfg consoleFlags
	consoleCfg.register(fs)
	operatorPoll := fs.Duration("operator-poll", admin.DefaultControlsPoll, "how often the operators' pool controls (curfew pool close|open) are read from the store: a control set through any replica holds on this one within it")
	if err := service.Parse(fs, args, os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	if err := o.Validate(); err != nil { // a bad common flag is a usage error too
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	if err := consoleCfg.validate(); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	if err := hedging.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator: --hedge-max-extra-load:", err)
		return 2
	}
	if *maxRuns < 1 || *minRun < 0 {
		fmt.Fprintln(os.Stderr, "orchestrator: --max-runs must be at least 1 and --min-run-time not negative")
		return 2
	}
	if *heartbeat < decoderlease.DefaultMinTick || (*decoderTTL != 0 && *decoderTTL < *heartbeat) {
		fmt.Fprintf(os.Stderr, "orchestrator: --decoder-heartbeat must be at least %v and --decoder-lease-ttl 0 or at least the heartbeat\n", decoderlease.DefaultMinTick)
		return 2
	}
	if *decoderFile != "" && (explicit(fs, "decoder-heartbeat") || explicit(fs, "decoder-lease-ttl")) {
		fmt.Fprintln(os.Stderr, "orchestrator: --decoder-config sets the heartbeat and lease TTL: give it or --decoder-heartbeat and --decoder-lease-ttl, not both")
		return 2
	}
	if *leaseTTL < 30*time.Millisecond {
		fmt.Fprintln(os.Stderr, "orchestrator: --lease-ttl must be at least 30ms")
		return 2
	}
	admCfg := orchestrator.DefaultAdmission()
	if *admissionFile != "" {
		c, err := admission.Load(*admissionFile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: --admission-config:", err)
			return 2
		}
		admCfg = c
	}
	if *operatorPoll <= 0 {
		fmt.Fprintln(os.Stderr, "orchestrator: --operator-poll must be positive, not", *operatorPoll)
		return 2
	}
	if *outboxBatch < 1 || *outboxInterval <= 0 || *outboxRate < 0 {
		fmt.Fprintln(os.Stderr, "orchestrator: --outbox-batch must be at least 1, --outbox-interval positive and --outbox-rate not negative")
		return 2
	}
	if *clusterTTL < 30*time.Millisecond || *clusterReplicas < 0 {
		fmt.Fprintln(os.Stderr, "orchestrator: --cluster-slot-ttl must be at least 30ms and --cluster-replicas not negative")
		return 2
	}
	if *natsURL != "" && *storeDSN == "" {
		fmt.Fprintln(os.Stderr, "orchestrator: --nats needs --store: dead letters are kept in the store first")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Without --store the runs are kept in a store private to this process: what needs a
	// store other processes read (API keys, dead letters, handing runs over) is off.
	st, err := memory.OpenOr(ctx, *storeDSN, "orchestrator")
	if err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator: --store:", err)
		return 2
	}
	defer func() { _ = st.Close() }()
	shared := st.Shared()
	// The public API acts only for authenticated tenants (docs/security.md): a verified
	// API key names the tenant; another orchestrator forwarding a call, or the curfew CLI,
	// names it in curfew-tenant; anyone else is refused.
	guard := &apikey.Guard{
		Methods: []string{
			"/" + orchestratorv1.OrchestratorService_ServiceDesc.ServiceName + "/",
			"/" + orchestratorv1.DeadLetterService_ServiceDesc.ServiceName + "/",
		},
		Peers: []string{meshtls.Orchestrator, meshtls.CLI},
		// An operator's key may act for any tenant (docs/security.md): the web console's
		// operators see every tenant's runs, as the curfew CLI on the mesh certificate does.
		OperatorTenants: true,
		ReadOnly:        publicReadOnly,
	}
	if shared {
		guard.Keys = &apikey.Authenticator{Keys: st}
	}
	// The operators' API admits curfew-cli and keys with an operator scope
	// (docs/operations.md); the public API, tenants.
	operators := &admin.Authorizer{Keys: guard.Keys}
	o.Authenticate = func(ctx context.Context, fullMethod, claimed string) (string, error) {
		if strings.HasPrefix(fullMethod, admin.Prefix) {
			return claimed, operators.Authorize(ctx, fullMethod)
		}
		return guard.Tenant(ctx, fullMethod, claimed)
	}
	rt, err := service.New(ctx, o, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 1
	}
	// On a shared store, at most the retry file's window.replicas orchestrators retry
	// calls to each of modelproxy and toolrunner at a time (docs/cluster.md).
	if err := rt.CoordinateRetries(st); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 2
	}
	// With a shared store, one half-open probe per service across the replicas.
	if _, err := rt.CoordinateBreakers(ctx, st); err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator:", err)
		return 1
	}
	guard.Log = rt.Log
	if guard.Keys != nil {
		guard.Keys.Log = rt.Log
	} else {
		rt.Log.Warn("no --store: no API keys, so only mesh peers (the curfew CLI, other orchestrators) may call this orchestrator; over --insecure, no one")
	}
	adv := advertiseAddr(*advertise, rt.Addr())
	if shared {
		if adv == "" {
			rt.Log.Warn("no --advertise-addr: a CancelRun of a run this orchestrator owns, received by another one, reaches only the run's leaves, and a WatchRun there gets no node events")
		} else {
			rt.Log.Info("run leases name this orchestrator's address for cancel and watch forwarding", "advertise_addr", adv)
		}
	}
	// Other orchestrators are reached as the mesh service "orchestrator", with this one's
	// certificate under --tls-dir.
	peers := &peerConns{creds: rt.Credentials(meshtls.Orchestrator)}
	var adm *admission.Controller
	if !*admissionOff {
		var cluster *clusterAdmission
		if shared && *clusterSlots {
			if cluster, err = newClusterAdmission(ctx, st, rt.Replica(), *clusterTTL, *clusterReplicas, rt.Log); err != nil {
				fmt.Fprintln(os.Stderr, "orchestrator: --cluster-admission:", err)
				return 2
			}
			admCfg.Cluster = cluster.config()
		}
		adm, err = admission.New(admCfg, rt.Registry)
		if err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: admission:", err)
			return 2
		}
		if cluster != nil {
			cluster.attach(adm)
			// Once Serve has returned (the runs torn down or handed over) and before the
			// store closes: the slots still held go back.
			defer cluster.close()
		}
		// Each authenticated call spends a token of its tenant's request rate. The
		// server does not serve before rt.Serve, below, so no call sees Limit unset.
		guard.Limit = adm.AllowRequest
	}
	if *admissionFile != "" {
		// Pools, tenant limits and budgets follow the file (docs/admission.md,
		// "Reloading the configuration"): a bad rewrite keeps the running ones.
		var apply func(admission.Config) error
		if adm != nil {
			apply = adm.Update
		}
		if _, err := service.WatchConfig(ctx, rt, configwatch.Config[admission.Config]{Name: "admission", Path: *admissionFile,
			Load: decodeAdmission, Apply: apply}); err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: --admission-config:", err)
			return 2
		}
	}
	var dead orchestrator.DeadLetterRecorder
	self := orchestrator.OwnerName(owner(), adv)
	if shared {
		rec := &dlq.Recorder{Store: st, Log: rt.Log}
		if *natsURL != "" {
			nc, err := nats.Connect(*natsURL, nats.Name("curfew-orchestrator"))
			if err != nil {
				fmt.Fprintln(os.Stderr, "orchestrator: --nats:", err)
				return 2
			}
			defer nc.Close()
			js, err := dlq.NewJetStream(ctx, nc, dlq.Config{Stream: *dlqStream})
			if err != nil {
				fmt.Fprintln(os.Stderr, "orchestrator: --nats:", err)
				return 2
			}
			rec.Publisher = js
			// Every replica runs the relay; it publishes only while it holds the relay
			// lease in the store (docs/outbox.md). Its loop ends with the process.
			relay, err := outbox.New(ctx, nc, st, outbox.Config{Stream: *outboxStream, SubjectPrefix: *outboxPrefix, Batch: *outboxBatch, Interval: *outboxInterval,
				Rate: *outboxRate, LeaseTTL: *leaseTTL, Owner: self, Log: rt.Log, Registerer: rt.Registry})
			if err != nil {
				fmt.Fprintln(os.Stderr, "orchestrator: --nats:", err)
				return 2
			}
			go relay.Run(ctx)
			rt.Registry.MustRegister(outbox.LagCollector(st, time.Second))
		}
		dead = rec
		rt.Registry.MustRegister(dlq.DepthCollector(st, time.Second))
	}
	conns := map[string]string{"--modelproxy": *modelAddr, "--toolrunner": *toolAddr, "--subagent": *subAddr}
	cc := map[string]*grpcConn{}
	for flagName, addr := range conns {
		if flagName == "--subagent" {
			continue // read for node reports only, below
		}
		c, err := rt.Dial(strings.TrimPrefix(flagName, "--"), addr)
		if err != nil {
			fmt.Fprintf(os.Stderr, "orchestrator: %s: %v\n", flagName, err)
			return 2
		}
		defer c.Close()
		cc[flagName] = c
	}
	mc, tc := cc["--modelproxy"], cc["--toolrunner"]
	// Node reports ask every replica of a service (a headless Service resolves to each
	// ready pod): a run's nodes are in the tables of the replicas that ran them.
	reports := map[string]meshv1.NodeReportServiceClient{}
	var decoders *replicas.Set // every modelproxy replica, for the admin API's decoder leases
	for flagName, addr := range conns {
		name := strings.TrimPrefix(flagName, "--")
		descs := []grpc.ServiceDesc{meshv1.NodeReportService_ServiceDesc}
		if name == "modelproxy" {
			descs = append(descs, modelproxyv1.ModelProxyService_ServiceDesc)
		}
		set, err := rt.Replicas(name, addr, descs...)
		if err != nil {
			fmt.Fprintf(os.Stderr, "orchestrator: %s: %v\n", flagName, err)
			return 2
		}
		defer func() { _ = set.Close() }()
		reports[name] = replicas.NodeReports(set)
		if name == "modelproxy" {
			decoders = set
		}
	}
	// One toolrunner client for the loop and the front door, so that both ask the same
	// toollist.Lister (one cached list per tenant).
	tools, models := toolrunnerv1.NewToolRunnerServiceClient(tc), modelproxyv1.NewModelProxyServiceClient(mc)
	// The process-wide keeper of the model client renews the decoders' leases
	// (docs/leases.md); its warnings go to the service's log, and --decoder-config
	// changes its timing live.
	leases := decoderlease.Shared(models, decoderlease.Options{Log: rt.Log, Period: *heartbeat, TTL: *decoderTTL})
	if *decoderFile != "" {
		if err := service.WatchDecoder(ctx, rt, *decoderFile, leases); err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: --decoder-config:", err)
			return 2
		}
	}
	hedges, err := hedging.Policy(rt.Registry)
	if err != nil {
		fmt.Fprintln(os.Stderr, "orchestrator: --hedge-max-extra-load:", err)
		return 2
	}
	srv := orchestrator.New(orchestrator.Config{
		NodeRetention: rt.Opts.Retention,
		Loop: agent.Config{
			Model:      models,
			ModelNodes: reports["modelproxy"],
			Tools:      tools,
			ToolNodes:  reports["toolrunner"],
			ModelName:  *model,
			Leases:     leases,
			Hedge:      hedges,
		},
		Reports:     []meshv1.NodeReportServiceClient{reports["modelproxy"], reports["toolrunner"], reports["subagent"]},
		MaxRuns:     *maxRuns,
		MinRunTime:  *minRun,
		MaxRunTime:  o.MaxDeadline,
		Log:         rt.Log,
		LogPrompts:  *logPrompts,
		Store:       st,
		Sheds:       st,
		Owner:       self,
		Peers:       peers.client,
		LeaseTTL:    *leaseTTL,
		DeadLetters: dead,
		Registerer:  rt.Registry,
		Admission:   adm,
	})
	orchestratorv1.RegisterOrchestratorServiceServer(rt.Server, srv)
	rt.RecordConfigs(ctx, st)
	acfg := admin.Config{Store: st, Replica: self, Breakers: rt.Breakers, RetryWindows: rt.RetryWindows(), Decoders: decoders, Log: rt.Log}
	if adm != nil {
		pools := admin.NewPoolControls(st, adm, self, rt.Log)
		go pools.Run(ctx, *operatorPoll)
		acfg.Pools = pools
		acfg.Tenants = adm // the tenants' settings (approver_not_starter) follow the admission file
	}
	admin.New(acfg).Register(rt.Server)
	if shared {
		orchestratorv1.RegisterDeadLetterServiceServer(rt.Server, orchestrator.NewDeadLetterServer(st, srv.Replay))
	}
	// The lease loops outlive the signal: the runs in flight are heartbeaten through the
	// drain, until Shutdown stops the loops (Drain stops the takeovers first).
	srv.Start(context.WithoutCancel(ctx))
	go service.Every(ctx, rt.Opts.SweepEvery(), srv.Sweep)
	go service.Every(ctx, orchestrator.ShedFlushPeriod, srv.FlushSheds)
	rt.OnStop(func() { srv.FlushSheds(time.Now()) })
	// The drain (docs/leases.md#drain): when the stop begins, no new runs and no more takeovers;
	// the runs in flight go on until shortly before the stop deadline, when those left are
	// handed over to another orchestrator (attached Run streams then end, so they do not
	// hold the server's graceful stop). Shutdown, once the server has stopped and before
	// the runtime flushes the runs' spans, waits for their teardown until the deadline.
	rt.OnDrain(func() { srv.Drain(rt.StopDeadline()) })
	rt.OnStop(func() { srv.Shutdown(rt.StopDeadline()) })
	rt.OnStop(peers.close)
	if *openaiAddr != "" {
		closeOpenAI, err := serveOpenAI(ctx, rt, openaiapi.Config{DefaultModel: *model, DisconnectGrace: *openaiGrace}, *openaiAddr, guard.Keys, tools, models)
		if err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: --openai-addr:", err)
			return 2
		}
		rt.OnDrain(closeOpenAI)
	}
	if consoleCfg.addr != "" {
		closeConsole, err := serveConsole(ctx, rt, consoleCfg, st, guard.Keys, shared)
		if err != nil {
			fmt.Fprintln(os.Stderr, "orchestrator: --console-addr:", err)
			return 2
		}
		rt.OnDrain(closeConsole)
	}
	err = rt.Serve(ctx)
	if err != nil {
		rt.Log.Error("serve", "error", err.Error())
		return 1
	}
	return 0
}

type grpcConn = grpc.ClientConn

// publicReadOnly reports the public API's methods that change nothing, which an
// operator's read-only key may call for any tenant.
func publicReadOnly(fullMethod string) bool {
	o, d := "/"+orchestratorv1.OrchestratorService_ServiceDesc.ServiceName+"/", "/"+orchestratorv1.DeadLetterService_ServiceDesc.ServiceName+"/"
	switch fullMethod {
	case o + "GetRun", o + "WatchRun", o + "ListRuns", d + "ListDeadLetters", d + "GetDeadLetter":
		return true
	}
	return false
}

// owner names this process incarnation in run leases: host, pid and a random suffix, so
// that a restarted orchestrator is a new owner and fencing tells the two apart.
func owner() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("orchestrator/%s/%d/%s", host, os.Getpid(), uuid.NewString()[:8])
}

// advertiseAddr is --advertise-addr, else the bound gRPC address when its host is a
// specific one (not 0.0.0.0 or ::), else "".
func advertiseAddr(flagValue, bound string) string {
	if flagValue != "" {
		return flagValue
	}
	host, _, err := net.SplitHostPort(bound)
	if ip := net.ParseIP(host); err != nil || host == "" || (ip != nil && ip.IsUnspecified()) {
		return ""
	}
	return bound
}

// peerConns are the connections to other orchestrators, one per address, for CancelRun
// forwarding: the mesh client chain without retries (the caller falls back when the
// owner is unreachable).
type peerConns struct {
	creds credentials.TransportCredentials
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// maxPeerConns bounds the connections kept to other orchestrators.
const maxPeerConns = 64

func (p *peerConns) client(addr string) (orchestratorv1.OrchestratorServiceClient, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.conns[addr]
	if c == nil {
		var err error
		if c, err = service.Dial(addr, p.creds); err != nil {
			return nil, err
		}
		if len(p.conns) >= maxPeerConns { // owners come and go (pods): start afresh
			for _, old := range p.conns {
				_ = old.Close()
			}
			p.conns = nil
		}
		if p.conns == nil {
			p.conns = map[string]*grpc.ClientConn{}
		}
		p.conns[addr] = c
	}
	return orchestratorv1.NewOrchestratorServiceClient(c), nil
}

func (p *peerConns) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// decodeAdmission decodes and validates the content of --admission-config.
func decodeAdmission(b []byte) (admission.Config, error) { return admission.Decode(bytes.NewReader(b)) }

// explicit reports whether the flag name was set on the command line or in the
// environment.
func explicit(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
