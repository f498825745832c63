package soak

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Report is what a load found. Durations are in milliseconds.
type Report struct {
	Concurrency int            `json:"concurrency"`
	Duration    string         `json:"duration"`
	Mix         Mix            `json:"mix"`
	Seed        uint64         `json:"seed"`
	Started     time.Time      `json:"started"`
	Drained     time.Time      `json:"drained"` // the last run ended
	Processes   []Process      `json:"processes"`
	Runs        int            `json:"runs"`    // started: given an id
	Refused     map[string]int `json:"refused"` // starts refused, by gRPC code
	// Outcomes counts the runs by end: the run's status, and its error code when it
	// failed ("FAILED/INVALID_ARGUMENT"); "LOST" is a run whose end was never seen nor
	// stored.
	Outcomes map[string]int      `json:"outcomes"`
	Kinds    map[Kind]KindReport `json:"kinds"`
	Lost     []string            `json:"lost,omitempty"` // run ids
	// Throughput is the runs ended per second while the load started new ones.
	Throughput float64 `json:"throughput_runs_per_second"`
	// CPUSeconds is each process's CPU time over the load; RunsPerCoreSecond the runs
	// ended per second of CPU of all of them (a restarted process's counter restarts:
	// counted from its restart).
	CPUSeconds        map[string]float64 `json:"cpu_seconds"`
	RunsPerCoreSecond float64            `json:"runs_per_core_second"`
	StartLatency      Percentiles        `json:"start_latency_ms"`
	// CancelLatency is from the client's CancelRun to the run's last decoder ending.
	CancelLatency Percentiles `json:"cancel_latency_ms"`
	// DeadlineOvershoot is from a run's deadline to its last decoder ending.
	DeadlineOvershoot Percentiles `json:"deadline_overshoot_ms"`
	// OrphanTokens are the tokens decoded after a cancel, in all and at most per
	// decoder; DecodersOverOne counts decoders with more than one.
	OrphanTokens          int64 `json:"orphan_tokens"`
	MaxOrphanPerDecoder   int64 `json:"max_orphan_tokens_per_decoder"`
	DecodersOverOneOrphan int   `json:"decoders_over_one_orphan_token"`
	// OverOne are the decoders with more than one token after their cancel, to say
	// which and when (the faults' instants are in Faults).
	OverOne     []OrphanDecoder `json:"decoders_over_one,omitempty"`
	WatchBreaks int             `json:"watch_breaks"`
	Effects     *Effects        `json:"effects,omitempty"`
	// Faults are the faults injected, when each happened and its error.
	Faults []FaultRecord `json:"faults,omitempty"`
	// Baseline and After are every process sampled (after a forced collection where it
	// serves profiles) before the load and once it drained and settled.
	Baseline []Sample `json:"baseline"`
	After    []Sample `json:"after"`
	Samples  []Sample `json:"samples"`
	// Series is the load per second: runs ended, and latency percentiles of those.
	Series []Second `json:"series"`
	// GoroutineSlack is the slack of the goroutine check (Config.GoroutineSlack).
	GoroutineSlack int `json:"goroutine_slack"`
	// TokensAfterCancel is the bound of the tokens check (Config.TokensAfterCancel).
	TokensAfterCancel int64   `json:"tokens_after_cancel_bound"`
	Checks            []Check `json:"checks"`
}

// KindReport is one kind's runs.
type KindReport struct {
	Runs     int            `json:"runs"`
	Outcomes map[string]int `json:"outcomes"`
	// Latency is from StartRun sent to the end seen, over the kind's runs that ended.
	Latency Percentiles `json:"latency_ms"`
}

// OrphanDecoder is a decoder that decoded more than one token after its run's cancel.
type OrphanDecoder struct {
	Run    string  `json:"run"`
	Node   string  `json:"node"`
	Kind   Kind    `json:"kind"`
	Tokens int64   `json:"tokens_after_cancel"`
	At     float64 `json:"cancel_at_s,omitempty"` // the client's CancelRun, since the load's start
	// CancelToLast is from the run's cancel to its last decoder's end, in milliseconds.
	CancelToLast float64 `json:"cancel_to_last_decoder_ms,omitempty"`
}

// Percentiles summarise a distribution, in milliseconds.
type Percentiles struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// Second is one second of the load.
type Second struct {
	At        float64 `json:"at_s"` // since the start
	Ended     int     `json:"ended"`
	ToolsP50  float64 `json:"tools_p50_ms"` // the Tools kind's run latency
	ToolsP99  float64 `json:"tools_p99_ms"`
	CancelP99 float64 `json:"cancel_p99_ms"`
}

// Check is one invariant of the load and whether it held.
type Check struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

// GoroutineSlack is how far a process's goroutines may stay above their pre-load count
// once the load drained, by default (Config.GoroutineSlack): pooled connections and the
// runtime's own workers vary by a few. A leak grows with the runs, by hundreds or
// thousands in a load, far past it.
const GoroutineSlack = 10

// ClusterGoroutineSlack is the Cluster's: a replica opens its connections to the other
// services' replicas (a gRPC client connection holds three goroutines: reader, writer,
// keepalive) as calls need them, and again after a peer restarts, so after a load with
// kills a replica may hold a few more connections than at its baseline, of up to eight
// peer replicas.
const ClusterGoroutineSlack = 30

func percentiles(ds []time.Duration) Percentiles {
	if len(ds) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	q := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return float64(s[max(i, 0)]) / 1e6
	}
	return Percentiles{N: len(s), P50: q(0.50), P90: q(0.90), P99: q(0.99), Max: float64(s[len(s)-1]) / 1e6}
}

// label is a run's outcome label.
func label(o outcome) string {
	if o.id == "" {
		return "REFUSED/" + o.startErr.String()
	}
	if !terminal(o.final) {
		return "LOST"
	}
	l := o.final.GetStatus().String()[len("RUN_STATUS_"):]
	if o.final.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_FAILED && o.final.GetErrorCode() != "" {
		l += "/" + o.final.GetErrorCode()
	}
	return l
}

func newReport(cfg Config, begin, drained time.Time, outs []outcome, samples, baseline, after []Sample) *Report {
	r := &Report{Concurrency: cfg.Concurrency, Duration: cfg.Duration.String(), Mix: cfg.Mix, Seed: cfg.Seed,
		Started: begin, Drained: drained, Processes: cfg.Processes, Refused: map[string]int{}, Outcomes: map[string]int{},
		Kinds: map[Kind]KindReport{}, CPUSeconds: map[string]float64{}, Baseline: baseline, After: after, Samples: samples}
	var starts, cancels, overshoots []time.Duration
	lat := map[Kind][]time.Duration{}
	stopAt := begin.Add(cfg.Duration)
	endedInLoad := 0
	for _, o := range outs {
		l := label(o)
		k := r.Kinds[o.kind]
		if k.Outcomes == nil {
			k.Outcomes = map[string]int{}
		}
		k.Outcomes[l]++
		if o.id == "" {
			r.Refused[o.startErr.String()]++
			r.Kinds[o.kind] = k
			continue
		}
		r.Runs++
		k.Runs++
		r.Outcomes[l]++
		r.WatchBreaks += o.watchErrs
		starts = append(starts, o.startLat)
		if l == "LOST" {
			r.Lost = append(r.Lost, o.id)
			r.Kinds[o.kind] = k
			continue
		}
		if !o.ended.After(stopAt) {
			endedInLoad++
		}
		lat[o.kind] = append(lat[o.kind], o.ended.Sub(o.started))
		last, models := lastDecoderEnd(o.final)
		if !o.cancelAt.IsZero() && models > 0 && o.final.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
			cancels = append(cancels, max(last.Sub(o.cancelAt), 0))
		}
		if o.final.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED && models > 0 && o.final.GetDeadline() != nil {
			overshoots = append(overshoots, max(last.Sub(o.final.GetDeadline().AsTime()), 0))
		}
		for _, n := range o.final.GetNodes() {
			if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
				continue
			}
			a := n.GetTokensAfterCancel()
			r.OrphanTokens += a
			r.MaxOrphanPerDecoder = max(r.MaxOrphanPerDecoder, a)
			if a > 1 {
				r.DecodersOverOneOrphan++
				od := OrphanDecoder{Run: o.id, Node: n.GetId(), Kind: o.kind, Tokens: a}
				if !o.cancelAt.IsZero() {
					od.At = o.cancelAt.Sub(r.Started).Seconds()
					od.CancelToLast = float64(last.Sub(o.cancelAt).Microseconds()) / 1000
				}
				r.OverOne = append(r.OverOne, od)
			}
		}
		r.Kinds[o.kind] = k
	}
	for kind, ds := range lat {
		k := r.Kinds[kind]
		k.Latency = percentiles(ds)
		r.Kinds[kind] = k
	}
	r.StartLatency = percentiles(starts)
	r.CancelLatency = percentiles(cancels)
	r.DeadlineOvershoot = percentiles(overshoots)
	r.Throughput = float64(endedInLoad) / cfg.Duration.Seconds()
	r.cpu(baseline, after)
	r.series(begin, outs)
	return r
}

// cpu fills CPUSeconds from the samples: per process, the sum of its counter's rises
// (a restart resets it).
func (r *Report) cpu(baseline, after []Sample) {
	by := map[string][]Sample{}
	for _, s := range append(append(slices.Clone(baseline), r.Samples...), after...) {
		if s.Up {
			by[s.Process] = append(by[s.Process], s)
		}
	}
	var total float64
	for p, ss := range by {
		sort.Slice(ss, func(i, j int) bool { return ss[i].At.Before(ss[j].At) })
		var c float64
		for i := 1; i < len(ss); i++ {
			if d := ss[i].CPUSeconds - ss[i-1].CPUSeconds; d > 0 {
				c += d
			} else if d < 0 {
				c += ss[i].CPUSeconds // restarted: its counter began again
			}
		}
		r.CPUSeconds[p] = c
		total += c
	}
	if total > 0 {
		ended := 0
		for k, n := range r.Outcomes {
			if k != "LOST" {
				ended += n
			}
		}
		r.RunsPerCoreSecond = float64(ended) / total
	}
}

// series buckets the runs by the second they ended in.
func (r *Report) series(begin time.Time, outs []outcome) {
	type bucket struct{ tools, cancels []time.Duration }
	var bs []bucket
	var ended []int
	for _, o := range outs {
		if o.id == "" || !terminal(o.final) {
			continue
		}
		i := int(o.ended.Sub(begin) / time.Second)
		for len(bs) <= i {
			bs = append(bs, bucket{})
			ended = append(ended, 0)
		}
		ended[i]++
		if o.kind == Tools && o.final.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			bs[i].tools = append(bs[i].tools, o.ended.Sub(o.started))
		}
		if last, n := lastDecoderEnd(o.final); !o.cancelAt.IsZero() && n > 0 {
			bs[i].cancels = append(bs[i].cancels, max(last.Sub(o.cancelAt), 0))
		}
	}
	for i, b := range bs {
		t, c := percentiles(b.tools), percentiles(b.cancels)
		r.Series = append(r.Series, Second{At: float64(i), Ended: ended[i], ToolsP50: t.P50, ToolsP99: t.P99, CancelP99: c.P99})
	}
}

// check evaluates the invariants that one load can show, once Effects is in.
func (r *Report) check() {
	add := func(name string, ok bool, format string, args ...any) {
		r.Checks = append(r.Checks, Check{Name: name, OK: ok, Detail: fmt.Sprintf(format, args...)})
	}
	add("no run lost", len(r.Lost) == 0, "%d of %d runs given an id never reached an end (ids in lost)", len(r.Lost), r.Runs)
	bound := max(r.TokensAfterCancel, 1)
	name := "at most one token after a cancel per decoder"
	if bound > 1 {
		name = fmt.Sprintf("at most %d tokens after a cancel per decoder", bound)
	}
	add(name, r.MaxOrphanPerDecoder <= bound,
		"%d decoders decoded more than one token after their cancel (at most %d; %d in all)", r.DecodersOverOneOrphan, r.MaxOrphanPerDecoder, r.OrphanTokens)
	for _, f := range r.Faults {
		add("fault injected: "+f.Name, f.Error == "", "at %.1f s %s", f.At, f.Error)
	}
	if r.Effects != nil {
		add("no duplicate side effect", r.Effects.Duplicates == 0, "%d of %d effect calls happened more than once", r.Effects.Duplicates, r.Effects.Calls)
	}
	before, after, restarted := map[string]Sample{}, map[string]Sample{}, map[string]bool{}
	for _, s := range r.Baseline {
		before[s.Process] = s
	}
	for _, s := range r.After {
		after[s.Process] = s
	}
	for _, s := range r.Samples {
		if !s.Up {
			restarted[s.Process] = true
		}
	}
	for _, s := range r.After {
		b, ok := before[s.Process]
		if !ok || !b.Up || !s.Up {
			add("goroutines back to baseline: "+s.Process, false, "not sampled before and after (up %v, %v)", b.Up, s.Up)
			continue
		}
		if !restarted[s.Process] {
			add("goroutines back to baseline: "+s.Process, s.Goroutines <= b.Goroutines+float64(r.GoroutineSlack),
				"%.0f before, %.0f after (slack %d)", b.Goroutines, s.Goroutines, r.GoroutineSlack)
			continue
		}
		// A process killed and restarted during the load has no baseline of its own (a
		// fresh process): its twin, another replica of its service that served the same
		// load without a restart, stands for it.
		twin, found := "", false
		for _, o := range r.After {
			if o.Process != s.Process && o.Up && !restarted[o.Process] && service(o.Process) == service(s.Process) {
				twin, found = o.Process, true
				break
			}
		}
		if !found {
			add("goroutines back to baseline: "+s.Process, true, "%.0f after; restarted during the load, no replica of its service to compare with", s.Goroutines)
			continue
		}
		t := after[twin]
		add("goroutines back to baseline: "+s.Process, s.Goroutines <= t.Goroutines+float64(r.GoroutineSlack),
			"%.0f after; restarted during the load, so compared with %s, which was not: %.0f (slack %d)", s.Goroutines, twin, t.Goroutines, r.GoroutineSlack)
	}
}

// service is the service of a replica's process name: "toolrunner" of "toolrunner-b".
func service(process string) string {
	if i := strings.LastIndexByte(process, '-'); i > 0 {
		return process[:i]
	}
	return process
}

// OK reports whether every check held.
func (r *Report) OK() bool {
	for _, c := range r.Checks {
		if !c.OK {
			return false
		}
	}
	return true
}

// WriteJSON writes the report to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644) //nolint:gosec // a report for people to read
}

// PlateauSlack is how much more heap in use (after a forced collection, once drained) a
// later load of the same size may leave than the first: more is growth, a leak's sign.
const PlateauSlack = 0.10

// Plateau compares two loads of the same size on the same mesh: every process's heap in
// use after the later one, collected, is within PlateauSlack of the first one's (or
// 4 MiB, below which the runtime's own variation dominates).
func Plateau(first, later *Report) []Check {
	before := map[string]Sample{}
	for _, s := range first.After {
		before[s.Process] = s
	}
	var out []Check
	for _, s := range later.After {
		b := before[s.Process]
		name := "heap plateau: " + s.Process
		if !b.Collected || !s.Collected {
			out = append(out, Check{Name: name, OK: false, Detail: "heap not read after a forced collection (the process needs --pprof)"})
			continue
		}
		limit := max(b.HeapInuse*(1+PlateauSlack), b.HeapInuse+4<<20)
		out = append(out, Check{Name: name, OK: s.HeapInuse <= limit,
			Detail: fmt.Sprintf("%.1f MiB after the first load, %.1f MiB after the last (limit %.1f MiB)", b.HeapInuse/(1<<20), s.HeapInuse/(1<<20), limit/(1<<20))})
	}
	return out
}
