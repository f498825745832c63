package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/curfew-mesh/curfew/mesh/outbox"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
)

// natsConn connects to the machine's NATS with JetStream (CURFEW_TEST_NATS_URL, default
// nats://127.0.0.1:4222), or skips (fails under CI=true).
func natsConn(t *testing.T) *nats.Conn {
	t.Helper()
	url := os.Getenv("CURFEW_TEST_NATS_URL")
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no NATS at %s: %v", url, err)
		}
		t.Skipf("no NATS at %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// rig is a store with notifies and a stream of its own with a 1 s duplicate window.
type rig struct {
	t      *testing.T
	st     store.Store
	nc     *nats.Conn
	stream string
	prefix string
}

func newRig(t *testing.T) *rig {
	t.Helper()
	nc := natsConn(t)
	tag := uuid.NewString()[:8]
	r := &rig{t: t, nc: nc, stream: "OUTBOX_TEST_" + tag, prefix: "test.outbox." + tag}
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: r.stream, Subjects: []string{r.prefix + ".>"},
		Storage: jetstream.MemoryStorage, Duplicates: time.Second}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), r.stream) })
	st, err := memory.Open(ctx, "memory://outbox-"+tag)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	r.st = st
	return r
}

func (r *rig) notify(tenant, key string, channels ...string) {
	r.t.Helper()
	ctx := context.Background()
	b, err := r.st.BeginTool(ctx, store.ToolBegin{Tenant: tenant, Key: key, Owner: "tr", TTL: time.Minute})
	if err != nil {
		r.t.Fatal(err)
	}
	var effects []store.Effect
	for _, c := range channels {
		effects = append(effects, store.Notify{Channel: c, Payload: []byte(key + "@" + c)})
	}
	if err := r.st.CompleteTool(ctx, b.Claim, nil, effects...); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rig) relay(st store.Outbox, owner string, reg prometheus.Registerer) *outbox.Relay {
	r.t.Helper()
	rl, err := outbox.New(context.Background(), r.nc, st, outbox.Config{Stream: r.stream, SubjectPrefix: r.prefix,
		Owner: owner, Interval: 10 * time.Millisecond, LeaseTTL: time.Second, Registerer: reg})
	if err != nil {
		r.t.Fatal(err)
	}
	return rl
}

// messages reads the whole stream.
func (r *rig) messages() []jetstream.Msg {
	r.t.Helper()
	js, _ := jetstream.New(r.nc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, r.stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		r.t.Fatal(err)
	}
	info, err := js.Stream(ctx, r.stream)
	if err != nil {
		r.t.Fatal(err)
	}
	n := info.CachedInfo().State.Msgs
	var out []jetstream.Msg
	for uint64(len(out)) < n {
		batch, err := cons.Fetch(int(n)-len(out), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			r.t.Fatal(err)
		}
		for m := range batch.Messages() {
			out = append(out, m)
		}
	}
	return out
}

// waitRelayed waits until the store has nothing pending.
func (r *rig) waitRelayed() {
	r.t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; {
		n, err := r.st.OutboxLag(context.Background())
		if err != nil {
			r.t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("lag still %d", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// crashAfterPublish is a store whose cursor write of the row at position crashAt on
// channel fails, as when the relay dies between the acknowledgement and the write: it
// calls crash and reports an error.
type crashAfterPublish struct {
	store.Store
	channel string
	crashAt int64
	crash   func()
	once    sync.Once
}

func (c *crashAfterPublish) AdvanceOutbox(ctx context.Context, l store.RelayLease, a store.CursorAdvance) error {
	if a.Channel == c.channel && a.To == c.crashAt {
		c.once.Do(c.crash)
		return errors.New("crashed")
	}
	return c.Store.AdvanceOutbox(ctx, l, a)
}

// A relay that dies between the stream's acknowledgement and its cursor write, replaced
// after the stream's duplicate window: every row is on the stream once, in order.
func TestExactlyOnceAfterTheDuplicateWindow(t *testing.T) {
	r := newRig(t)
	for i := range 5 {
		r.notify("acme", fmt.Sprint("call-", i), "ops", "dev.team")
	}
	ctx, crash := context.WithCancel(context.Background())
	first := r.relay(&crashAfterPublish{Store: r.st, channel: "ops", crashAt: 3, crash: crash}, "relay-1", nil)
	done := make(chan struct{})
	go func() { defer close(done); first.Run(ctx) }()
	<-done
	time.Sleep(1200 * time.Millisecond) // past the duplicate window

	reg := prometheus.NewRegistry()
	second := r.relay(r.st, "relay-2", reg)
	ctx2, stop := context.WithCancel(context.Background())
	done2 := make(chan struct{})
	go func() { defer close(done2); second.Run(ctx2) }()
	r.waitRelayed()
	stop()
	<-done2

	msgs := r.messages()
	if len(msgs) != 10 {
		t.Fatalf("%d messages on the stream, want 10", len(msgs))
	}
	next := map[string]int{}
	seen := map[string]bool{}
	for _, m := range msgs {
		id := m.Headers().Get(jetstream.MsgIDHeader)
		if seen[id] {
			t.Fatalf("message %s twice", id)
		}
		seen[id] = true
		pos, _ := strconv.Atoi(m.Headers().Get(outbox.HeaderChannelSeq))
		next[m.Subject()]++
		if pos != next[m.Subject()] {
			t.Fatalf("%s: position %d where %d was next", m.Subject(), pos, next[m.Subject()])
		}
	}
	if want := outbox.Subject(r.prefix, "acme", "dev.team"); next[want] != 5 {
		t.Fatalf("subjects %v, want 5 on %s", next, want)
	}
	if got := testutil.ToFloat64(mustVec(t, reg, "found")); got != 1 {
		t.Fatalf("found %v, want 1 (the row published before the crash)", got)
	}
}

func mustVec(t *testing.T, reg *prometheus.Registry, outcome string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "curfew_outbox_relayed_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == outcome {
				return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x"}, func() float64 { return m.GetCounter().GetValue() })
			}
		}
	}
	t.Fatalf("no curfew_outbox_relayed_total{outcome=%q}", outcome)
	return nil
}

// Two relays on one store: one holds the lease, and the rows are relayed once.
func TestOneRelayAtATime(t *testing.T) {
	r := newRig(t)
	for i := range 20 {
		r.notify("acme", fmt.Sprint("call-", i), "ops")
	}
	regs := []*prometheus.Registry{prometheus.NewRegistry(), prometheus.NewRegistry()}
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i, reg := range regs {
		rl := r.relay(r.st, fmt.Sprint("relay-", i), reg)
		wg.Go(func() { rl.Run(ctx) })
	}
	r.waitRelayed()
	leaders := 0.0
	for _, reg := range regs {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == "curfew_outbox_relay_leader" {
				leaders += mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
	}
	stop()
	wg.Wait()
	if leaders != 1 {
		t.Fatalf("%v leaders, want 1", leaders)
	}
	if n := len(r.messages()); n != 20 {
		t.Fatalf("%d messages, want 20", n)
	}
}

func TestToken(t *testing.T) {
	for in, want := range map[string]string{"ops": "ops", "a.b": "a%2Eb", "a%2Eb": "a%252Eb", "x y*>": "x%20y%2A%3E", "": ""} {
		if got := outbox.Token(in); got != want {
			t.Errorf("Token(%q) = %q, want %q", in, got, want)
		}
	}
}
