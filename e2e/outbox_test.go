package e2e

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/outbox"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// outboxRig is a crash rig whose orchestrators relay the outbox to a JetStream stream
// of the test's own, with a duplicate window of 1 s.
type outboxRig struct {
	*crashRig
	js             jetstream.JetStream
	stream, prefix string
	url            string
	runs           int // runs started so far
}

func newOutboxRig(t *testing.T) *outboxRig {
	t.Helper()
	url := natsURL(t)
	r := &outboxRig{crashRig: newCrashRig(t, ""), url: url}
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	if r.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	r.stream, r.prefix = "E2E_OUTBOX_"+strings.ToUpper(tag), "e2e.outbox."+tag
	if _, err := r.js.CreateStream(t.Context(), jetstream.StreamConfig{Name: r.stream, Subjects: []string{r.prefix + ".>"},
		Storage: jetstream.FileStorage, Duplicates: time.Second}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.js.DeleteStream(context.Background(), r.stream) })
	return r
}

// orchestrator adds and starts one relaying orchestrator, slowed to 10 publishes a
// second so that a kill lands in the middle of a batch.
func (r *outboxRig) orchestrator(name string) *meshproc.Proc {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := r.c.Add(ctx, "orchestrator", name, r.c.OrchestratorArgs(r.model, r.sub, r.tools, "--nats", r.url,
		"--outbox-stream", r.stream, "--outbox-subject-prefix", r.prefix, "--outbox-rate", "10", "--outbox-batch", "50",
		"--outbox-interval", "50ms", "--lease-ttl", "1s")...)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		r.t.Fatal(err)
	}
	return p
}

const outboxSteps = 8

// notifyPlan notifies outboxSteps times, one step after the other, alternating between
// two channels, then answers.
func notifyPlan(run int) string {
	var steps []string
	for s := range outboxSteps {
		steps = append(steps, fmt.Sprintf(`{"think_tokens": 1, "tools": [{"name": "notify", "args": {"channel": %q, "message": "run%d-step%d"}}]}`,
			[]string{"alpha", "beta.team"}[s%2], run, s))
	}
	return `{"tokens_per_second": 1000, "steps": [` + strings.Join(steps, ",") + `, {"answer_tokens": 1}]}`
}

// startRuns starts n notifying runs on o.
func (r *outboxRig) startRuns(o *meshproc.Proc, n int) {
	r.t.Helper()
	oc := r.client(o)
	for range n {
		i := r.runs
		r.runs++
		resp, err := oc.StartRun(r.t.Context(), &orchestratorv1.StartRunRequest{Task: notifyPlan(i),
			IdempotencyKey: fmt.Sprintf("%s-outbox-%d", r.tag, i), Timeout: durationpb.New(40 * time.Second)})
		if err != nil {
			r.t.Fatal(err)
		}
		r.runIDs = append(r.runIDs, resp.GetRun().GetRunId())
	}
}

func (r *outboxRig) streamMsgs() uint64 {
	r.t.Helper()
	s, err := r.js.Stream(r.t.Context(), r.stream)
	if err != nil {
		r.t.Fatal(err)
	}
	return s.CachedInfo().State.Msgs
}

func (r *outboxRig) waitStream(atLeast uint64, within time.Duration) {
	r.t.Helper()
	for deadline := time.Now().Add(within); r.streamMsgs() < atLeast; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			r.t.Fatalf("%d messages on the stream after %v, want at least %d", r.streamMsgs(), within, atLeast)
		}
	}
}

// waitRelayed waits until every run ended and nothing is pending.
func (r *outboxRig) waitRelayed(within time.Duration) {
	r.t.Helper()
	for _, run := range r.waitEnded(within) {
		if run.Status != store.StatusSucceeded {
			r.t.Fatalf("run %s ended %s: %s", run.RunID, run.Status, run.Error)
		}
	}
	for deadline := time.Now().Add(within); ; time.Sleep(50 * time.Millisecond) {
		n, err := r.st.OutboxLag(r.t.Context())
		if err != nil {
			r.t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("outbox lag %d after %v", n, within)
		}
	}
}

// checkExactlyOnce reads the whole stream and checks it against the runs' notifies:
// each once, in order per channel and per run.
func (r *outboxRig) checkExactlyOnce() {
	r.t.Helper()
	want := r.runs * outboxSteps
	if n := r.streamMsgs(); n != uint64(want) { //nolint:gosec // small
		r.t.Fatalf("%d messages on the stream, want %d (one per notify)", n, want)
	}
	cons, err := r.js.OrderedConsumer(r.t.Context(), r.stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		r.t.Fatal(err)
	}
	var msgs []jetstream.Msg
	for len(msgs) < want {
		batch, err := cons.Fetch(want-len(msgs), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			r.t.Fatal(err)
		}
		for m := range batch.Messages() {
			msgs = append(msgs, m)
		}
	}
	seen := map[string]bool{}
	pos := map[string]int{}      // subject: last position
	step := map[string]int{}     // run: next step
	payloads := map[string]int{} // payload: times
	for _, m := range msgs {
		h := m.Headers()
		id := h.Get(jetstream.MsgIDHeader)
		if seen[id] {
			r.t.Fatalf("message %s twice on the stream", id)
		}
		seen[id] = true
		p, _ := strconv.Atoi(h.Get(outbox.HeaderChannelSeq))
		if pos[m.Subject()]++; p != pos[m.Subject()] {
			r.t.Fatalf("%s: position %d after %d", m.Subject(), p, pos[m.Subject()]-1)
		}
		var run, s int
		if _, err := fmt.Sscanf(string(m.Data()), "run%d-step%d", &run, &s); err != nil {
			r.t.Fatalf("payload %q", m.Data())
		}
		k := strconv.Itoa(run)
		if s != step[k] {
			r.t.Fatalf("run %d: step %d on the stream where %d was next", run, s, step[k])
		}
		step[k]++
		payloads[string(m.Data())]++
		if ch := h.Get(outbox.HeaderChannel); m.Subject() != outbox.Subject(r.prefix, md.DefaultTenant, ch) {
			r.t.Fatalf("subject %s for channel %s", m.Subject(), ch)
		}
	}
	if len(payloads) != want {
		r.t.Fatalf("%d distinct notifies on the stream, want %d", len(payloads), want)
	}
	rows, err := outbox.List(r.t.Context(), r.st, store.OutboxQuery{Limit: 1000})
	if err != nil {
		r.t.Fatal(err)
	}
	for _, row := range rows {
		if row.State != outbox.StateRelayed || !seen[row.Key] {
			r.t.Fatalf("row %+v: not relayed, or not on the stream", row)
		}
	}
}

// leader reads curfew_outbox_relay_leader of a running orchestrator.
func leader(t *testing.T, p *meshproc.Proc) float64 {
	t.Helper()
	body, err := httpGet("http://" + p.AdminAddr + "/metrics")
	if err != nil {
		t.Fatalf("%s /metrics: %v", p.Name, err)
	}
	return parsePage(t, body).value("curfew_outbox_relay_leader", nil, false)
}

// The relay SIGKILLed in the middle of a batch and restarted after the stream's
// duplicate window: every notify is on JetStream once, in order per channel. Then two
// orchestrators: one relays at a time, and the other takes over when it dies.
func TestOutboxRelayExactlyOnce(t *testing.T) {
	r := newOutboxRig(t)
	a := r.orchestrator("orchestrator-a")
	// Right after its start, the series docs/metrics.md lists as known in advance with
	// --nats are served at their value.
	known, _ := docKnown(t)
	var withNATS []knownRow
	for _, row := range known {
		if row.nats {
			withNATS = append(withNATS, row)
		}
	}
	body, err := httpGet("http://" + a.AdminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	checkKnown(t, "orchestrator", parsePage(t, body), withNATS)
	r.startRuns(a, 3)
	r.waitStream(5, 30*time.Second)
	if n := r.streamMsgs(); n >= uint64(r.runs*outboxSteps) { //nolint:gosec // small
		t.Fatalf("all %d relayed before the kill: the relay is not slow enough to kill mid-batch", n)
	}
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	killedAt := r.streamMsgs()
	time.Sleep(1500 * time.Millisecond) // past the duplicate window
	if err := a.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	r.waitRelayed(60 * time.Second)
	time.Sleep(300 * time.Millisecond) // a duplicate would have landed by now
	r.checkExactlyOnce()
	t.Logf("%d of %d on the stream at the kill", killedAt, r.runs*outboxSteps)

	// Two orchestrators: exactly one holds the relay lease.
	b := r.orchestrator("orchestrator-b")
	r.startRuns(b, 2)
	for range 10 {
		la, lb := leader(t, a), leader(t, b)
		if la+lb != 1 {
			t.Fatalf("leaders: a %v, b %v; want exactly one", la, lb)
		}
		time.Sleep(100 * time.Millisecond)
	}
	holder, other := a, b
	if leader(t, b) == 1 {
		holder, other = b, a
	}
	if err := holder.Kill(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); leader(t, other) != 1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not take the relay over from %s", other.Name, holder.Name)
		}
	}
	r.waitRelayed(60 * time.Second)
	time.Sleep(300 * time.Millisecond)
	r.checkExactlyOnce()

	// The metrics docs/metrics.md lists "with --nats" are served.
	body, err = httpGet("http://" + other.AdminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	pg := parsePage(t, body)
	for _, row := range docMetrics(t) {
		for _, n := range row.names {
			if row.nats && pg.mfs[n] == nil {
				t.Errorf("%s: docs/metrics.md says the orchestrator serves it with --nats, but its /metrics lacks it", n)
			}
		}
	}
	if got := pg.value("curfew_outbox_lag", nil, false); got != 0 {
		t.Errorf("curfew_outbox_lag %v after everything was relayed", got)
	}
}
