package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/dlq"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// natsURL is the machine's NATS with JetStream (CURFEW_TEST_NATS_URL, default
// nats://127.0.0.1:4222). Without one the test is skipped locally and fails under CI=true.
func natsURL(t *testing.T) string {
	t.Helper()
	url := os.Getenv("CURFEW_TEST_NATS_URL")
	if url == "" {
		url = nats.DefaultURL
	}
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second))
	if err != nil {
		meshproc.Missing(t, "no NATS at %s (%v); set CURFEW_TEST_NATS_URL", url, err)
	}
	nc.Close()
	return url
}

// A step that fails for good becomes a dead letter in the store and on the JetStream
// stream; `curfew dlq replay` twice starts one replay run.
func TestDeadLetterOnNATSAndReplayOnce(t *testing.T) {
	url := natsURL(t)
	r := newCrashRig(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	o, err := r.c.Add(ctx, "orchestrator", "orchestrator", r.c.OrchestratorArgs(r.model, r.sub, r.tools, "--nats", url)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Start(ctx); err != nil {
		t.Fatal(err)
	}
	oc := r.client(o)
	plan := `{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 2, "tools": [{"name": "fail", "args": {"code": "INVALID_ARGUMENT", "times": 5}}]},
	  {"answer_tokens": 1}]}`
	start, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, IdempotencyKey: r.tag, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r.runIDs = []string{start.GetRun().GetRunId()}
	if run := r.waitEnded(30 * time.Second)[0]; run.Status != store.StatusFailed {
		t.Fatalf("run ended %s, want failed", run.Status)
	}

	// In the store, with its context.
	var d store.DeadLetter
	for deadline := time.Now().Add(10 * time.Second); ; {
		dls, _, err := r.st.ListDeadLetters(ctx, store.DeadLetterQuery{Tenant: md.DefaultTenant, RunID: start.GetRun().GetRunId()})
		if err != nil {
			t.Fatal(err)
		}
		if len(dls) == 1 {
			d = dls[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d dead letters for the run, want 1", len(dls))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if d.Step != "root/s0.t0" || d.ErrorType != "invalid_argument" || d.Attempts != 1 || d.IdempotencyKey != r.tag ||
		d.LastError == "" || len(d.Payload) == 0 {
		t.Errorf("dead letter %+v", d)
	}

	// On the stream.
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(ctx, dlq.DefaultStream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{dlq.DefaultSubjectPrefix + "." + md.DefaultTenant}})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for !found {
		batch, err := cons.Fetch(100, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			var msg dlq.Message
			if json.Unmarshal(m.Data(), &msg) == nil && msg.ID == d.ID {
				found = msg.RunID == d.RunID && msg.Step == d.Step && msg.ErrorType == d.ErrorType
			}
		}
		if n == 0 {
			t.Fatalf("dead letter %s not on stream %s", d.ID, dlq.DefaultStream)
		}
	}

	// Replay twice through the CLI: one replay run.
	replay := func() orchestratorv1.ReplayDeadLetterResponse {
		cmd := exec.CommandContext(ctx, r.c.Bin("curfew"), "dlq", "replay", d.ID, "--addr", o.Addr, "--insecure", "--timeout", "20s", "--json")
		cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+r.c.APIKey) // a plaintext cluster: the CLI authenticates with a key
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("curfew dlq replay: %v\n%s", err, out)
		}
		var resp struct {
			RunID   string `json:"run_id"`
			Created bool   `json:"created"`
		}
		if err := json.Unmarshal(out, &resp); err != nil {
			t.Fatalf("replay output %s: %v", out, err)
		}
		return orchestratorv1.ReplayDeadLetterResponse{RunId: resp.RunID, Created: resp.Created}
	}
	first, second := replay(), replay()
	if !first.GetCreated() || second.GetCreated() || first.GetRunId() == "" || second.GetRunId() != first.GetRunId() {
		t.Fatalf("replays: %v/%v then %v/%v, want one run started once", first.GetRunId(), first.GetCreated(), second.GetRunId(), second.GetCreated())
	}
	runs, _, err := r.st.ListRuns(ctx, store.RunQuery{Tenant: md.DefaultTenant, Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	replays := 0
	for _, run := range runs {
		if run.IdempotencyKey == "dlq-replay/"+d.ID {
			replays++
		}
	}
	if replays != 1 {
		t.Errorf("%d replay runs in the store, want 1", replays)
	}
	got, err := r.st.GetDeadLetter(ctx, md.DefaultTenant, d.ID)
	if err != nil || got.ReplayCount != 1 || got.ReplayedAt.IsZero() {
		t.Errorf("dead letter after replays: %+v %v", got, err)
	}
}

// StartRun with one key twice gives one run; the run goes on after its client has gone.
func TestStartRunDetachedAndIdempotent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	key := "detached-" + time.Now().Format(time.RFC3339Nano)
	plan := `{"tokens_per_second": 50, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 1000}}]},
	  {"answer_tokens": 5}]}`
	req := &orchestratorv1.StartRunRequest{Task: plan, IdempotencyKey: key, Timeout: durationpb.New(20 * time.Second)}
	// A client of its own, closed right after the two starts: the run must not notice.
	conn, err := mesh.Conn("orchestrator")
	if err != nil {
		t.Fatal(err)
	}
	oc := orchestratorv1.NewOrchestratorServiceClient(conn)
	a, err := oc.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := oc.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	if !a.GetCreated() || b.GetCreated() || a.GetRun().GetRunId() != b.GetRun().GetRunId() {
		t.Fatalf("two StartRuns with one key: %s/%v and %s/%v, want one run", a.GetRun().GetRunId(), a.GetCreated(), b.GetRun().GetRunId(), b.GetCreated())
	}
	s := openMeshStore(t)
	for {
		run, err := s.GetRun(ctx, md.DefaultTenant, a.GetRun().GetRunId())
		if err != nil {
			t.Fatal(err)
		}
		if run.Status.Terminal() {
			if run.Status != store.StatusSucceeded {
				t.Fatalf("detached run ended %s: %s", run.Status, run.Error)
			}
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("detached run did not end")
		case <-time.After(50 * time.Millisecond):
		}
	}
	list, err := client(t).ListRuns(ctx, &orchestratorv1.ListRunsRequest{PageSize: 500})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range list.GetRuns() {
		if r.GetIdempotencyKey() == key {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d runs with key %s, want 1", n, key)
	}
}
