package dlq_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/dlq"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// natsConn connects to the machine's NATS server (CURFEW_TEST_NATS_URL, default
// nats://127.0.0.1:4222). Without one the test is skipped locally and fails under CI=true.
func natsConn(t *testing.T) *nats.Conn {
	t.Helper()
	url := os.Getenv("CURFEW_TEST_NATS_URL")
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second), nats.Name("curfew-dlq-test"))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("NATS at %s: %v (CI needs it: scripts/test.sh starts it)", url, err)
		}
		t.Skipf("no NATS at %s (%v); set CURFEW_TEST_NATS_URL", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// publisher creates a stream of the test's own and deletes it after the test.
func publisher(t *testing.T, nc *nats.Conn) (*dlq.JetStream, jetstream.JetStream) {
	t.Helper()
	ctx := context.Background()
	suffix := fmt.Sprintf("%d", time.Now().UnixNano())
	p, err := dlq.NewJetStream(ctx, nc, dlq.Config{Stream: "CURFEW_DLQ_TEST_" + suffix, SubjectPrefix: "curfew.test" + suffix + ".dlq"})
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), p.Stream()) })
	return p, js
}

func openStore(t *testing.T) store.Store {
	t.Helper()
	s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// messages reads every message of the stream.
func messages(t *testing.T, js jetstream.JetStream, stream string) []dlq.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []dlq.Message
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		var msg dlq.Message
		if err := json.Unmarshal(m.Data, &msg); err != nil {
			t.Fatalf("message %d is not a dead letter: %v", seq, err)
		}
		out = append(out, msg)
	}
	return out
}

func letter(run, step string) store.DeadLetter {
	return store.DeadLetter{Tenant: "acme.corp", RunID: run, Step: step, ErrorType: "UNAVAILABLE", Attempts: 3,
		LastError: "tool backend down", Payload: []byte(`{"name":"notify"}`), IdempotencyKey: "k-" + step}
}

// A dead letter lands in the store and once on the stream, with its structured context;
// recording the same step again adds and publishes nothing.
func TestRecordStoresAndPublishesOnce(t *testing.T) {
	nc := natsConn(t)
	p, js := publisher(t, nc)
	st := openStore(t)
	r := &dlq.Recorder{Store: st, Publisher: p}
	ctx := context.Background()
	dl, added, err := r.Record(ctx, letter("run-1", "2"))
	if err != nil || !added || dl.ID == "" {
		t.Fatalf("Record: %v added=%v %+v", err, added, dl)
	}
	again, added, err := r.Record(ctx, letter("run-1", "2"))
	if err != nil || added || again.ID != dl.ID {
		t.Fatalf("second Record: %v added=%v id %s (first %s)", err, added, again.ID, dl.ID)
	}
	msgs := messages(t, js, p.Stream())
	if len(msgs) != 1 {
		t.Fatalf("%d messages on the stream, want 1", len(msgs))
	}
	m := msgs[0]
	if m.ID != dl.ID || m.RunID != "run-1" || m.Step != "2" || m.ErrorType != "UNAVAILABLE" || m.Attempts != 3 ||
		m.LastError != "tool backend down" || string(m.Payload) != `{"name":"notify"}` || m.IdempotencyKey != "k-2" || m.Timestamp.IsZero() {
		t.Fatalf("message %+v", m)
	}
	if !strings.HasSuffix(p.Subject("acme.corp"), ".acme_corp") {
		t.Fatalf("subject %q: a tenant is one subject token", p.Subject("acme.corp"))
	}
	stored, err := st.GetDeadLetter(ctx, "acme.corp", dl.ID)
	if err != nil || stored.RunID != "run-1" {
		t.Fatalf("store: %v %+v", err, stored)
	}
}

// Publishing the same dead letter twice stores one message (the stream dedupes on its id).
func TestPublishIsIdempotent(t *testing.T) {
	nc := natsConn(t)
	p, js := publisher(t, nc)
	st := openStore(t)
	dl, _, err := st.AddDeadLetter(context.Background(), letter("run-2", "0"))
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := p.Publish(context.Background(), dl); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(messages(t, js, p.Stream())); n != 1 {
		t.Fatalf("%d messages, want 1", n)
	}
}

// With the broker gone, the dead letter is still recorded, and the caller is told.
func TestPublishFailureKeepsTheRecord(t *testing.T) {
	nc := natsConn(t)
	p, _ := publisher(t, nc)
	st := openStore(t)
	nc.Close()
	r := &dlq.Recorder{Store: st, Publisher: p}
	dl, added, err := r.Record(context.Background(), letter("run-3", "1"))
	if !errors.Is(err, dlq.ErrNotPublished) || !added {
		t.Fatalf("Record with the broker gone: %v added=%v", err, added)
	}
	if _, err := st.GetDeadLetter(context.Background(), "acme.corp", dl.ID); err != nil {
		t.Fatalf("not in the store: %v", err)
	}
}

// curfew_dlq_depth counts open dead letters, read from the store.
func TestDepthCollector(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	a, _, err := st.AddDeadLetter(ctx, letter("run-4", "0"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.AddDeadLetter(ctx, letter("run-4", "1")); err != nil {
		t.Fatal(err)
	}
	c := dlq.DepthCollector(st, 5*time.Second)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	if v := testutil.ToFloat64(c); v != 2 {
		t.Fatalf("depth %v, want 2", v)
	}
	if _, err := st.MarkReplayed(ctx, "acme.corp", a.ID); err != nil {
		t.Fatal(err)
	}
	if v := testutil.ToFloat64(c); v != 1 {
		t.Fatalf("depth %v after a replay, want 1", v)
	}
	if n, err := testutil.GatherAndCount(reg, "curfew_dlq_depth"); err != nil || n != 1 {
		t.Fatalf("gather: %d %v", n, err)
	}
}

func TestBadSubjectPrefix(t *testing.T) {
	nc := natsConn(t)
	if _, err := dlq.NewJetStream(context.Background(), nc, dlq.Config{Stream: "X", SubjectPrefix: "a.*"}); err == nil {
		t.Fatal("a wildcard prefix was accepted")
	}
}
