package soak

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Config is one load.
type Config struct {
	// Orchestrators take the runs, in turn.
	Orchestrators []orchestratorv1.OrchestratorServiceClient
	// Processes are sampled every SampleEvery (their /metrics), before, during and
	// after the load.
	Processes []Process
	// Concurrency is how many runs are kept in flight; DefaultConcurrency when 0.
	Concurrency int
	// Duration is how long new runs start; the runs in flight then finish (each bounded
	// by its own deadline).
	Duration time.Duration
	Mix      Mix
	// Seed makes the draws of kinds and cancel instants repeatable; 0 draws one.
	Seed uint64
	// SampleEvery is the processes' sampling period; DefaultSampleEvery when 0.
	SampleEvery time.Duration
	// Settle is how long after the last run ended the processes are given to return to
	// their baseline before the last sample; DefaultSettle when 0.
	Settle time.Duration
	// Warmup is a load of the same mix and concurrency run before the measured one, so
	// that the baseline has the connections, pools and caches a mesh keeps once it has
	// served (a fresh process has none of them); DefaultWarmup when 0, none when < 0.
	Warmup time.Duration
	// Effects, if set, counts the MCP effect tool's side effects after the load (the
	// server's record of calls): see Effects.
	Effects func() (Effects, error)
	// ProfileDir, if set, receives a CPU profile of ProfileFor (DefaultProfileFor when 0)
	// and an allocation profile of every process serving profiles (--pprof), taken from
	// the load's middle: <process>.cpu.pprof and <process>.allocs.pprof, for `go tool
	// pprof`.
	ProfileDir string
	ProfileFor time.Duration
	// Faults happen during the load, each At after its start (a SIGKILL of a process, a
	// store restarted); the report records when each happened and its error.
	Faults []Fault
	// DumpDir, if set, receives the goroutines of every process whose count did not
	// return to its baseline (<process>.goroutines.txt, /debug/pprof/goroutine?debug=1),
	// to say what was left running.
	DumpDir string
	// WatchShare is the share of runs followed by WatchRun, every event of them streamed
	// to the load as a console watching them would; the others are polled with GetRun
	// every PollEvery, as a batch client does. DefaultWatchShare when 0; none when < 0.
	WatchShare float64
	PollEvery  time.Duration
	// Ramp spreads the workers' first runs evenly over its length, in the warm-up and in
	// the load, as traffic grows rather than arriving in one instant (200 starts at
	// once are a burst no client makes); DefaultRamp when 0, none when < 0.
	Ramp time.Duration
	// GoroutineSlack is how far a process's goroutines may end above their count before
	// the load; GoroutineSlack (the constant) when 0.
	GoroutineSlack int
	// TokensAfterCancel is the most tokens a decoder may decode after its run's cancel;
	// DefaultTokensAfterCancel (the bound, one) when 0.
	TokensAfterCancel int64
	// Log, if set, receives a line per second of progress.
	Log io.Writer
}

// Defaults of Config.
const (
	DefaultConcurrency = 200
	DefaultSampleEvery = time.Second
	DefaultSettle      = 5 * time.Second
	// DefaultTokensAfterCancel is issue 26's bound: at most one token after a cancel.
	DefaultTokensAfterCancel = 1
	DefaultWarmup            = 5 * time.Second
	DefaultProfileFor        = 10 * time.Second
	DefaultWatchShare        = 0.1
	DefaultPollEvery         = 500 * time.Millisecond
	DefaultRamp              = 3 * time.Second
)

// Fault is one fault the load injects: Do runs At after the load's start.
type Fault struct {
	At   time.Duration
	Name string
	Do   func(ctx context.Context) error
}

// FaultRecord is a fault as it happened.
type FaultRecord struct {
	Name  string  `json:"name"`
	At    float64 `json:"at_s"` // since the load's start
	Error string  `json:"error,omitempty"`
}

// Effects is what the MCP server saw: the logical calls (a run's tool node), and those
// whose effect happened under more than one idempotency key, that is more than once.
type Effects struct {
	Calls      int `json:"calls"`
	Duplicates int `json:"duplicates"`
}

// outcome is one run as the load saw it.
type outcome struct {
	kind      Kind
	id        string        // "" when the start was refused
	startErr  codes.Code    // the start's code when refused
	started   time.Time     // when StartRun was sent
	startLat  time.Duration // StartRun's round trip
	ended     time.Time     // when the load saw its end
	final     *orchestratorv1.Run
	cancelAt  time.Time // when the client sent its cancel; zero if it did not
	watchErrs int       // WatchRun streams broken before the end (a replica killed)
}

// Drive runs the load and returns its report.
func Drive(ctx context.Context, cfg Config) (*Report, error) {
	if len(cfg.Orchestrators) == 0 {
		return nil, errors.New("soak: no orchestrator to drive")
	}
	if err := cfg.Mix.Validate(); err != nil {
		return nil, err
	}
	if cfg.Duration <= 0 {
		return nil, errors.New("soak: the duration must be positive")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.SampleEvery <= 0 {
		cfg.SampleEvery = DefaultSampleEvery
	}
	if cfg.GoroutineSlack <= 0 {
		cfg.GoroutineSlack = GoroutineSlack
	}
	if cfg.TokensAfterCancel <= 0 {
		cfg.TokensAfterCancel = DefaultTokensAfterCancel
	}
	if cfg.Ramp == 0 {
		cfg.Ramp = DefaultRamp
	}
	if cfg.Settle <= 0 {
		cfg.Settle = DefaultSettle
	}
	if cfg.Seed == 0 {
		cfg.Seed = mrand.Uint64() //nolint:gosec // the load's draws, reported to repeat them: no secret
	}
	if cfg.Warmup == 0 {
		cfg.Warmup = DefaultWarmup
	}
	if cfg.WatchShare == 0 {
		cfg.WatchShare = DefaultWatchShare
	}
	if cfg.PollEvery <= 0 {
		cfg.PollEvery = DefaultPollEvery
	}
	load := rand.Text()[:8] // names this load's runs and effects apart from any other's

	if cfg.Warmup > 0 {
		drive(ctx, cfg, load+"-warmup", time.Now().Add(cfg.Warmup), nil)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(cfg.Settle):
		}
	}
	smp := newSampler(cfg.Processes, cfg.SampleEvery)
	baseline := smp.settled(ctx)
	sctx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() { defer close(sampled); smp.run(sctx) }()

	begin := time.Now()
	var (
		mu       sync.Mutex
		outcomes []outcome
	)
	progress := make(chan struct{})
	go func() {
		defer close(progress)
		if cfg.Log == nil {
			return
		}
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-sampled:
				return
			case <-t.C:
				mu.Lock()
				n := len(outcomes)
				mu.Unlock()
				_, _ = fmt.Fprintf(cfg.Log, "soak: %4.0fs  %d runs ended\n", time.Since(begin).Seconds(), n)
			}
		}
	}()
	faulted := make(chan []FaultRecord, 1)
	go func() { faulted <- inject(ctx, begin, cfg.Faults) }()
	profiled := make(chan error, 1)
	if cfg.ProfileDir != "" {
		go func() { profiled <- smp.profile(ctx, cfg, begin) }()
	} else {
		profiled <- nil
	}
	drive(ctx, cfg, load, begin.Add(cfg.Duration), func(o outcome) {
		mu.Lock()
		outcomes = append(outcomes, o)
		mu.Unlock()
	})
	drained := time.Now()
	faults := <-faulted
	// Lost runs: an id whose end the load never saw is read once more from the store.
	for i := range outcomes {
		o := &outcomes[i]
		if o.id != "" && !terminal(o.final) {
			if r, err := cfg.Orchestrators[0].GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: o.id}); err == nil {
				o.final = r.GetRun()
			}
		}
	}
	select {
	case <-ctx.Done():
	case <-time.After(cfg.Settle):
	}
	stopSampling()
	<-sampled
	<-progress
	perr := <-profiled
	after := smp.settled(ctx)
	rep := newReport(cfg, begin, drained, outcomes, smp.samples(), baseline, after)
	rep.Faults = faults
	if cfg.Effects != nil {
		e, err := cfg.Effects()
		if err != nil {
			return rep, fmt.Errorf("soak: counting effects: %w", err)
		}
		rep.Effects = &e
	}
	rep.GoroutineSlack, rep.TokensAfterCancel = cfg.GoroutineSlack, cfg.TokensAfterCancel
	rep.check()
	if cfg.DumpDir != "" {
		if err := smp.dumpLeft(ctx, cfg.DumpDir, baseline, after, cfg.GoroutineSlack); err != nil && perr == nil {
			perr = err
		}
	}
	if perr != nil {
		return rep, perr
	}
	return rep, ctx.Err()
}

// inject runs the faults at their instants after begin, in order, and returns what
// happened; it stops at ctx's end.
func inject(ctx context.Context, begin time.Time, faults []Fault) []FaultRecord {
	fs := slices.Clone(faults)
	slices.SortFunc(fs, func(a, b Fault) int { return cmp.Compare(a.At, b.At) })
	var out []FaultRecord
	for _, f := range fs {
		select {
		case <-ctx.Done():
			return out
		case <-time.After(time.Until(begin.Add(f.At))):
		}
		r := FaultRecord{Name: f.Name, At: time.Since(begin).Seconds()}
		if err := f.Do(ctx); err != nil {
			r.Error = err.Error()
		}
		out = append(out, r)
	}
	return out
}

// drive keeps cfg.Concurrency runs of the mix in flight, named load-<n>, until stopAt,
// then waits for the runs in flight; record, if set, receives each run's outcome.
func drive(ctx context.Context, cfg Config, load string, stopAt time.Time, record func(outcome)) {
	var (
		seq atomic.Int64
		wg  sync.WaitGroup
	)
	for w := range cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := mrand.New(mrand.NewPCG(cfg.Seed, uint64(w))) //nolint:gosec // repeatable draws of kinds and cancel instants: no secret
			door := frontDoor{orchs: cfg.Orchestrators, first: w}
			if cfg.Ramp > 0 { // the workers start spread over the ramp, not all in one instant
				select {
				case <-ctx.Done():
				case <-time.After(cfg.Ramp * time.Duration(w) / time.Duration(cfg.Concurrency)):
				}
			}
			for ctx.Err() == nil && time.Now().Before(stopAt) {
				watch := rnd.Float64() < cfg.WatchShare
				o := runOne(ctx, door, cfg, cfg.Mix.pick(rnd), fmt.Sprintf("soak-%s-%d", load, seq.Add(1)), watch, rnd)
				if record != nil {
					record(o)
				}
				if o.id == "" {
					time.Sleep(50 * time.Millisecond) // refused: back off a little, as a client would
				}
			}
		}()
	}
	wg.Wait()
}

// frontDoor is how a worker reaches the orchestrators: its own replica first, and after
// a failed call the next one, as a client behind a Service's load balancer would (any
// replica takes a run's GetRun, WatchRun and CancelRun, forwarding them to the run's
// owner).
type frontDoor struct {
	orchs []orchestratorv1.OrchestratorServiceClient
	first int
}

// at is the orchestrator of a call's try-th attempt.
func (d frontDoor) at(try int) orchestratorv1.OrchestratorServiceClient {
	return d.orchs[(d.first+try)%len(d.orchs)]
}

// runOne starts one run, cancels it when its kind says so, and follows it to its end:
// by WatchRun when watch is set, else by polling GetRun.
func runOne(ctx context.Context, door frontDoor, cfg Config, k Kind, name string, watch bool, rnd *mrand.Rand) outcome {
	req, cancelAfter := cfg.Mix.request(k, name, rnd)
	o := outcome{kind: k, started: time.Now()}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	resp, err := door.at(0).StartRun(sctx, req)
	cancel()
	o.startLat = time.Since(o.started)
	if err != nil {
		o.startErr = status.Code(err)
		o.ended = time.Now()
		return o
	}
	o.id = resp.GetRun().GetRunId()
	bound := req.GetTimeout().AsDuration() + 30*time.Second // the run's own deadline, and margin for a takeover
	rctx, cancelRun := context.WithTimeout(ctx, bound)
	defer cancelRun()
	var cancelled chan time.Time
	if cancelAfter > 0 {
		cancelled = make(chan time.Time, 1)
		t := time.AfterFunc(cancelAfter, func() {
			at := time.Now()
			cancelled <- at
			// Retried while the orchestrator is unreachable: the client's cancel must land.
			for try := 0; rctx.Err() == nil; try++ {
				_, err := door.at(try).CancelRun(rctx, &orchestratorv1.CancelRunRequest{RunId: o.id, Reason: "soak: the client cancels"})
				if err == nil || status.Code(err) == codes.FailedPrecondition || status.Code(err) == codes.NotFound {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
		defer t.Stop()
	}
	if watch {
		o.final, o.watchErrs = follow(rctx, door, o.id)
	} else {
		o.final = poll(rctx, door, o.id, cfg.PollEvery)
	}
	o.ended = time.Now()
	if e := o.final.GetEndedAt(); e != nil {
		o.ended = e.AsTime() // when it ended, not when the load saw it
	}
	if cancelled != nil {
		select {
		case o.cancelAt = <-cancelled:
		default:
		}
	}
	return o
}

// follow watches run id to its end, watching again when a stream breaks (its
// orchestrator killed or draining: another one follows the run), and reads it with
// GetRun when it can watch no more.
func follow(ctx context.Context, door frontDoor, id string) (*orchestratorv1.Run, int) {
	breaks := 0
	for ctx.Err() == nil {
		orch := door.at(breaks)
		st, err := orch.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
		if err == nil {
			for {
				ev, err := st.Recv()
				if err != nil {
					break
				}
				if f := ev.GetFinished(); f != nil {
					return f, breaks
				}
			}
		}
		breaks++
		if r, err := orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id}); err == nil && terminal(r.GetRun()) {
			return r.GetRun(), breaks
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil, breaks
}

// poll reads run id every period until it has ended.
func poll(ctx context.Context, door frontDoor, id string, period time.Duration) *orchestratorv1.Run {
	for try := 0; ; {
		r, err := door.at(try).GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err == nil && terminal(r.GetRun()) {
			return r.GetRun()
		}
		if err != nil {
			try++ // the next replica
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(period):
		}
	}
}

// terminal reports whether r has ended.
func terminal(r *orchestratorv1.Run) bool {
	switch r.GetStatus() {
	case orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED, orchestratorv1.RunStatus_RUN_STATUS_FAILED,
		orchestratorv1.RunStatus_RUN_STATUS_CANCELLED, orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED:
		return true
	}
	return false
}

// lastDecoderEnd is when r's last model node ended, and how many model nodes it had.
func lastDecoderEnd(r *orchestratorv1.Run) (time.Time, int) {
	var last time.Time
	n := 0
	for _, nd := range r.GetNodes() {
		if nd.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
			continue
		}
		n++
		if e := nd.GetEndedAt().AsTime(); nd.GetEndedAt() != nil && e.After(last) {
			last = e
		}
	}
	return last, n
}
