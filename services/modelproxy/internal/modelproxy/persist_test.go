package modelproxy

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/sim"
)

const testTenant = "acme"

// durable is a SQLite store in a test directory, and a read-only view of its ledger rows.
type durable struct {
	path string
	s    store.Store
}

func openDurable(t *testing.T, path string) *durable {
	t.Helper()
	if path == "" {
		path = filepath.Join(t.TempDir(), "curfew.db")
	}
	s, err := sqlite.Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return &durable{path: path, s: s}
}

// row is one token_ledger row.
type row struct {
	tenant, run, node, kind, key string
	tokens                       int64
}

// rows reads the run's output and orphan ledger rows in insertion order, straight from
// the database file.
func (d *durable) rows(t *testing.T, run string) []row {
	t.Helper()
	return d.query(t, run, "kind <> '"+store.KindPrompt+"'")
}

// promptRows reads the run's prompt ledger rows (store.KindPrompt) in insertion order.
func (d *durable) promptRows(t *testing.T, run string) []row {
	t.Helper()
	return d.query(t, run, "kind = '"+store.KindPrompt+"'")
}

// query reads the run's ledger rows that satisfy cond, in insertion order.
func (d *durable) query(t *testing.T, run, cond string) []row {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+d.path+"?_pragma=query_only(1)")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	rs, err := db.QueryContext(context.Background(), `SELECT tenant, run_id, node_id, kind, COALESCE(entry_key, ''), tokens
		FROM token_ledger WHERE run_id = ? AND `+cond+` ORDER BY id`, run)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rs.Close() }()
	var out []row
	for rs.Next() {
		var r row
		if err := rs.Scan(&r.tenant, &r.run, &r.node, &r.kind, &r.key, &r.tokens); err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func (d *durable) usage(t *testing.T, run string) store.Usage {
	t.Helper()
	u, err := d.s.TokenUsage(context.Background(), testTenant, run)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// persistEnv is newEnv with the server persisting its ledger to d.
func persistEnv(t *testing.T, d *durable) *env {
	t.Helper()
	return persistEnvOn(t, d.s)
}

// persistEnvOn is newEnv with the server persisting its ledger to st.
func persistEnvOn(t *testing.T, st LedgerStore) *env {
	t.Helper()
	srv := New(st)
	srv.Log = slog.New(slog.DiscardHandler)
	cc := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	t.Cleanup(func() { flush(t, srv) }) // runs before the store closes (cleanups run last-in first-out)
	return &env{srv: srv, model: modelproxyv1.NewModelProxyServiceClient(cc), report: meshv1.NewNodeReportServiceClient(cc)}
}

// tenantIdent is ident with a tenant.
func tenantIdent(run, node string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{Tenant: testTenant, RunID: run, NodeID: node})
}

// delivered sums the tokens of the chunks a caller received.
func delivered(chunks []*modelproxyv1.GenerateResponse) int64 {
	var n int64
	for _, c := range chunks {
		n += int64(c.GetTokens())
	}
	return n
}

const fivePlan = `{"tokens_per_second":1000,"steps":[{"answer_tokens":5}]}`

// One decoder appends one entry with the tokens it streamed; the same node decoded again
// (in this process, and by a restarted modelproxy on the same database) appends a new
// entry each time, so a regenerated step's spend is visible, and the store's usage of
// the node is what the streams delivered.
func TestLedgerPersistsOneEntryPerDecoder(t *testing.T) {
	d := openDurable(t, "")
	e := persistEnv(t, d)
	const run, node = "r-persist", "root/m0"
	ctx := metadata.AppendToOutgoingContext(tenantIdent(run, node), md.RetryID, "retry-1", md.Attempt, "2")
	chunks, err := generate(ctx, t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	flush(t, e.srv)
	first := delivered(chunks)
	if first != 5 {
		t.Fatalf("delivered %d tokens, want 5", first)
	}
	rows := d.rows(t, run)
	if len(rows) != 1 {
		t.Fatalf("ledger rows = %+v, want one", rows)
	}
	r := rows[0]
	if r.tenant != testTenant || r.node != node || r.kind != KindOutput || r.tokens != first {
		t.Fatalf("row = %+v, want tenant %s, node %s, kind output, %d tokens", r, testTenant, node, first)
	}
	if want := "modelproxy/" + run + "/" + node + "/retry-1/2/"; !strings.HasPrefix(r.key, want) {
		t.Fatalf("key %q, want the prefix %q (run/node/retry-id/attempt) and the decoder's nonce", r.key, want)
	}

	// The same node again (a new call: the client mints a new retry id): a second entry.
	chunks, err = generate(tenantIdent(run, node), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	flush(t, e.srv)
	second := delivered(chunks)
	rows = d.rows(t, run)
	if len(rows) != 2 || rows[1].tokens != second || rows[1].key == rows[0].key || !strings.HasPrefix(rows[1].key, "modelproxy/"+run+"/"+node+"/") {
		t.Fatalf("after a second decode rows = %+v, want a second output entry of %d tokens under its own key", rows, second)
	}

	// A restarted modelproxy (new server, the store reopened) decodes the node again.
	if err := d.s.Close(); err != nil {
		t.Fatal(err)
	}
	d = openDurable(t, d.path)
	e = persistEnv(t, d)
	chunks, err = generate(tenantIdent(run, node), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	flush(t, e.srv)
	third := delivered(chunks)
	if rows = d.rows(t, run); len(rows) != 3 {
		t.Fatalf("after a restart rows = %+v, want three entries", rows)
	}
	u := d.usage(t, run)
	if want := first + second + third; u.ByNode[node] != want || u.Total != want || u.ByProvider[SimModel] != want {
		t.Fatalf("usage = %+v, want %d tokens on %s, all decoded by %s (what the three streams delivered)", u, want, node, SimModel)
	}
	if want := 3 * sim.PromptTokens(conversation(fivePlan, 0)); u.Prompt != want || len(d.promptRows(t, run)) != 3 {
		t.Fatalf("prompt usage %d in %d rows, want %d in one row per decoder", u.Prompt, len(d.promptRows(t, run)), want)
	}
	if u, _ := d.s.TokenUsage(context.Background(), md.DefaultTenant, run); u.Total != 0 {
		t.Fatalf("another tenant sees %+v", u)
	}
}

// A cancelled decoder appends the tokens it emitted up to the cancel.
func TestLedgerPersistsCancelledDecoder(t *testing.T) {
	d := openDurable(t, "")
	e := persistEnv(t, d)
	const run, node = "r-persist-cancel", "root/m0"
	// 20 tokens/s: 50 ms between tokens, ample time for the RST_STREAM to arrive.
	p := `{"tokens_per_second":20,"steps":[{"answer_tokens":1000}]}`
	ctx, cancel := context.WithCancel(tenantIdent(run, node))
	defer cancel()
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
	if err != nil {
		t.Fatal(err)
	}
	var received int64
	for range 3 {
		c, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		received += int64(c.GetTokens())
	}
	cancel()
	if _, err := meshtest.Drain(st); status.Code(err) != codes.Canceled {
		t.Fatalf("stream after cancel: %v, want CANCELED", err)
	}
	// The caller does not wait for the decoder to end: wait for its node, then for its append.
	meshtest.WaitNode(t, e.srv.Nodes, run, node)
	var rows []row
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		flush(t, e.srv)
		if rows = d.rows(t, run); len(rows) > 0 || time.Now().After(deadline) {
			break
		}
	}
	emitted, _, _ := e.srv.Ledger.Figures(run, node, time.Time{})
	if len(rows) != 1 || rows[0].kind != KindOutput || rows[0].tokens != emitted || emitted < received {
		t.Fatalf("rows = %+v, want one output entry of the %d tokens the decoder emitted (%d received)", rows, emitted, received)
	}
	if u := d.usage(t, run); u.ByNode[node] != emitted {
		t.Fatalf("usage = %+v, want %d on %s", u, emitted, node)
	}
}

// A call without a run id, and a decoder that emitted nothing, append nothing.
func TestLedgerNotPersistedWithoutRunOrTokens(t *testing.T) {
	d := openDurable(t, "")
	e := persistEnv(t, d)
	if _, err := generate(context.Background(), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)}); err != nil {
		t.Fatal(err)
	}
	fault := `{"steps":[{"answer_tokens":3,"model_error":{"attempts":1}}]}`
	_, err := generate(tenantIdent("r-none", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fault, 0)})
	meshtest.WantCode(t, err, codes.Unavailable)
	flush(t, e.srv)
	for _, run := range []string{"", unattributed, "r-none"} {
		if rows := d.rows(t, run); len(rows) != 0 {
			t.Fatalf("run %q has rows %+v, want none", run, rows)
		}
	}
	if total, _, _ := e.srv.Ledger.Figures(unattributed, unattributed, time.Time{}); total != 5 {
		t.Fatalf("the in-memory ledger has %d unattributed tokens, want 5 as before", total)
	}
}

// Tokens recorded after the decoder's context was cancelled are appended as a separate
// orphan entry; the two entries together are what the decoder emitted.
func TestLedgerPersistsOrphanTokens(t *testing.T) {
	d := openDurable(t, "")
	s := New(d.s)
	defer flush(t, s)
	base := time.Unix(1_700_000_000, 0)
	clock := base
	s.now = func() time.Time { return clock }

	const run, node = "r-orphan", "root/m0"
	ctx, cancel := context.WithCancel(md.WithIdentity(context.Background(), md.Identity{Tenant: testTenant, RunID: run, NodeID: node}))
	sp := s.newSpend(ctx, run, node, run, s.decoderKey(ctx, run, node))
	sp.record(base.Add(10*time.Millisecond), 3, SimModel)
	clock = base.Add(20 * time.Millisecond)
	cancel() // the cancel instant is the clock's: +20 ms
	sp.record(base.Add(30*time.Millisecond), 2, SimModel)
	sp.prompt(9)
	output, orphan, prompt := sp.end(SimModel)
	if output != 3 || orphan != 2 || prompt != 9 {
		t.Fatalf("split = %d output, %d orphan, %d prompt; want 3, 2 and 9", output, orphan, prompt)
	}
	if total, before, after := s.Ledger.Figures(run, node, clock); total != 5 || before != 3 || after != 2 {
		t.Fatalf("in-memory figures = %d, %d, %d; want 5, 3, 2", total, before, after)
	}
	flush(t, s)
	if pr := d.promptRows(t, run); len(pr) != 1 || pr[0].tokens != 9 || pr[0].key == "" {
		t.Fatalf("prompt rows = %+v, want one of 9 tokens under the decoder's key", pr)
	}
	rows := d.rows(t, run)
	if len(rows) != 2 || rows[0].kind != KindOutput || rows[0].tokens != 3 || rows[1].kind != KindOrphan || rows[1].tokens != 2 ||
		rows[1].key != rows[0].key+"/orphan" || !strings.HasPrefix(rows[0].key, "modelproxy/"+run+"/"+node+"/-/1/") {
		t.Fatalf("rows = %+v, want output 3 and orphan 2 under the decoder's key", rows)
	}
	if u := d.usage(t, run); u.ByNode[node] != 5 || u.PromptByNode[node] != 9 {
		t.Fatalf("usage = %+v, want 5 output and 9 prompt tokens on %s", u, node)
	}

	// Without a cancel every token is output.
	ictx := md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: node})
	sp = s.newSpend(ictx, run, node, run, s.decoderKey(ictx, run, node))
	sp.record(clock, 4, SimModel)
	if output, orphan, _ := sp.end(SimModel); output != 4 || orphan != 0 {
		t.Fatalf("uncancelled split = %d, %d; want 4, 0", output, orphan)
	}
}

// outage is a LedgerStore over a real store whose appends fail while down, as those to
// a PostgreSQL being restarted do.
type outage struct {
	LedgerStore
	down    atomic.Bool
	refused atomic.Int64
}

func (o *outage) AddTokens(ctx context.Context, es ...store.LedgerEntry) (int, error) {
	if o.down.Load() {
		o.refused.Add(1)
		return 0, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	}
	return o.LedgerStore.AddTokens(ctx, es...)
}

// A store that fails costs neither the call nor its tokens: the appends are retried until
// the store is back, and each entry lands once.
func TestLedgerEntriesOutliveAStoreOutage(t *testing.T) {
	d := openDurable(t, "")
	o := &outage{LedgerStore: d.s}
	o.down.Store(true)
	e := persistEnvOn(t, o)
	e.srv.persister.retryBase = time.Millisecond
	const run = "r-outage"
	chunks, err := generate(tenantIdent(run, "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil || delivered(chunks) != 5 {
		t.Fatalf("call with a failing store: %d tokens, %v; want 5, nil", delivered(chunks), err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for o.refused.Load() < 3 { // retried, not dropped
		if time.Now().After(deadline) {
			t.Fatalf("%d appends tried while the store was down, want retries", o.refused.Load())
		}
		time.Sleep(time.Millisecond)
	}
	if rows := d.rows(t, run); len(rows) != 0 {
		t.Fatalf("rows while down: %+v", rows)
	}
	o.down.Store(false)
	flush(t, e.srv)
	rows := d.rows(t, run)
	if len(rows) != 1 || rows[0].tokens != 5 || rows[0].kind != KindOutput {
		t.Fatalf("rows after the outage = %+v, want one output entry of 5 tokens", rows)
	}
	if u := d.usage(t, run); u.ByNode["root/m0"] != 5 {
		t.Fatalf("usage = %+v, want the 5 tokens", u)
	}
}

// A store that never comes back bounds Flush: what is still queued is dropped, logged
// and counted in its error, and the writer ends.
func TestLedgerFlushBoundedWhileTheStoreFails(t *testing.T) {
	d := openDurable(t, "")
	o := &outage{LedgerStore: d.s}
	o.down.Store(true)
	e := persistEnvOn(t, o)
	chunks, err := generate(tenantIdent("r-gone", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil || delivered(chunks) != 5 {
		t.Fatalf("call with a failing store: %d tokens, %v; want 5, nil", delivered(chunks), err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err = e.srv.Flush(ctx)
	if err == nil || !strings.Contains(err.Error(), "entries not persisted") {
		t.Fatalf("Flush = %v, want the entries it gave up on", err)
	}
	o.down.Store(false)
	flush(t, e.srv) // nothing queued any more: returns at once
	if rows := d.rows(t, "r-gone"); len(rows) != 0 {
		t.Fatalf("rows = %+v, want none: they were given up", rows)
	}
}

// A decoder that streams longer than the checkpoint interval has its tokens in the store
// before it ends, so a modelproxy killed mid-stream loses at most the last interval; its
// parts together are exactly what it emitted, split at the cancel.
func TestLedgerCheckpointsAStreamingDecoder(t *testing.T) {
	d := openDurable(t, "")
	s := New(d.s)
	defer flush(t, s)
	base := time.Unix(1_700_000_000, 0)
	clock := base
	s.now = func() time.Time { return clock }

	const run, node = "r-parts", "root/m0"
	ctx, cancel := context.WithCancel(md.WithIdentity(context.Background(), md.Identity{Tenant: testTenant, RunID: run, NodeID: node}))
	defer cancel()
	sp := s.newSpend(ctx, run, node, run, s.decoderKey(ctx, run, node))
	sp.record(clock, 3, SimModel) // within the first interval: nothing queued yet
	flush(t, s)
	if rows := d.rows(t, run); len(rows) != 0 {
		t.Fatalf("rows within the first interval = %+v, want none", rows)
	}
	clock = clock.Add(spendCheckpoint)
	sp.record(clock, 2, SimModel) // an interval later: the 5 so far are queued
	flush(t, s)
	if rows := d.rows(t, run); len(rows) != 1 || rows[0].tokens != 5 || rows[0].kind != KindOutput {
		t.Fatalf("rows after a checkpoint = %+v, want one output entry of 5", rows)
	}
	clock = clock.Add(time.Millisecond)
	cancel()                                            // at clock
	sp.record(clock.Add(time.Millisecond), 1, SimModel) // after the cancel: an orphan
	sp.prompt(4)
	if output, orphan, prompt := sp.end(SimModel); output != 5 || orphan != 1 || prompt != 4 {
		t.Fatalf("end = %d, %d, %d; want 5, 1, 4", output, orphan, prompt)
	}
	flush(t, s)
	rows := d.rows(t, run)
	if len(rows) != 2 || rows[1].kind != KindOrphan || rows[1].tokens != 1 || !strings.HasSuffix(rows[0].key, "/1") ||
		rows[1].key != strings.TrimSuffix(rows[0].key, "/1")+"/2/orphan" {
		t.Fatalf("rows = %+v, want part 1 (output 5) and part 2 (orphan 1) under the decoder's key", rows)
	}
	if u := d.usage(t, run); u.ByNode[node] != 6 || u.PromptByNode[node] != 4 {
		t.Fatalf("usage = %+v, want 6 output and 4 prompt tokens", u)
	}
}

// Through Generate: a decode of two seconds is in the store while it still streams.
func TestLedgerHasADecoderWhileItStreams(t *testing.T) {
	d := openDurable(t, "")
	e := persistEnv(t, d)
	e.srv.checkpoint = 50 * time.Millisecond
	const run = "r-streaming"
	plan := `{"tokens_per_second":20,"steps":[{"answer_tokens":40}]}`
	type result struct {
		chunks []*modelproxyv1.GenerateResponse
		err    error
	}
	done := make(chan result, 1)
	go func() {
		c, err := generate(tenantIdent(run, "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(plan, 0)})
		done <- result{c, err}
	}()
	var during int64
	for during == 0 {
		select {
		case r := <-done:
			t.Fatalf("the decoder ended (%v) before any of its tokens were in the store", r.err)
		case <-time.After(10 * time.Millisecond):
		}
		during = d.usage(t, run).ByNode["root/m0"]
	}
	r := <-done
	if r.err != nil || delivered(r.chunks) != 40 {
		t.Fatalf("call: %d tokens, %v; want 40, nil", delivered(r.chunks), r.err)
	}
	flush(t, e.srv)
	if got := d.usage(t, run).ByNode["root/m0"]; during >= 40 || got != 40 {
		t.Fatalf("in the store: %d while streaming, %d at the end; want some, then all 40", during, got)
	}
}

// batches is a LedgerStore over a real store that records the size of each append and
// can hold the first one until released.
type batches struct {
	LedgerStore
	mu      sync.Mutex
	sizes   []int
	started chan struct{} // closed when the first append begins, if hold is set
	hold    chan struct{} // the first append waits for it to close; nil: no wait
}

func (b *batches) AddTokens(ctx context.Context, es ...store.LedgerEntry) (int, error) {
	b.mu.Lock()
	b.sizes = append(b.sizes, len(es))
	first := len(b.sizes) == 1
	b.mu.Unlock()
	if first && b.hold != nil {
		close(b.started)
		<-b.hold
	}
	return b.LedgerStore.AddTokens(ctx, es...)
}

func (b *batches) seen() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.sizes)
}

// decoderEnded queues the entries of n decoders of run ending, each with 3 output tokens
// and 1 orphan token: 2n entries.
func decoderEnded(s *Server, run string, n int) {
	for i := range n {
		node := fmt.Sprintf("root/m%d", i)
		ctx, cancel := context.WithCancel(md.WithIdentity(context.Background(), md.Identity{Tenant: testTenant, RunID: run, NodeID: node}))
		sp := s.newSpend(ctx, run, node, run, s.decoderKey(ctx, run, node))
		sp.record(time.Now().Add(-time.Hour), 3, SimModel)
		cancel()
		sp.record(time.Now().Add(time.Hour), 1, SimModel) // after any cancel instant
		sp.end(SimModel)
	}
}

// Decoders ending together (a cancelled tree of 64 leaves) are appended in one
// transaction, after the delay, not one each as they end; Flush cuts the delay short, and
// nothing is lost.
func TestLedgerBurstIsOneTransaction(t *testing.T) {
	d := openDurable(t, "")
	b := &batches{LedgerStore: d.s}
	s := New(b)
	s.persister.delay = time.Minute // only Flush ends it
	const run = "r-burst"
	decoderEnded(s, run, 64)
	time.Sleep(50 * time.Millisecond)
	if got := b.seen(); len(got) != 0 {
		t.Fatalf("appends during the delay: %v, want none", got)
	}
	start := time.Now()
	flush(t, s)
	if waited := time.Since(start); waited > 20*time.Second {
		t.Fatalf("Flush took %v: it did not cut the writer's delay short", waited)
	}
	if got := b.seen(); !slices.Equal(got, []int{128}) {
		t.Fatalf("appends %v, want one of 128 entries", got)
	}
	if rows := d.rows(t, run); len(rows) != 128 {
		t.Fatalf("%d ledger rows, want 128", len(rows))
	}
	if u := d.usage(t, run); u.Total != 64*4 || u.ByNode["root/m63"] != 4 {
		t.Fatalf("usage %+v, want 4 tokens on each of 64 nodes", u)
	}

	// More than a batch holds: appended in batches of persistBatch.
	decoderEnded(s, "r-big", 600)
	flush(t, s)
	if got := b.seen()[1:]; !slices.Equal(got, []int{persistBatch, persistBatch, 1200 - 2*persistBatch}) {
		t.Fatalf("appends of 1200 entries %v, want %d, %d, %d", got, persistBatch, persistBatch, 1200-2*persistBatch)
	}
	if rows := d.rows(t, "r-big"); len(rows) != 1200 {
		t.Fatalf("%d ledger rows, want 1200", len(rows))
	}
}

// Without Flush the entries land by themselves after the delay.
func TestLedgerAppendsAfterDelay(t *testing.T) {
	d := openDurable(t, "")
	s := New(d.s)
	defer flush(t, s)
	decoderEnded(s, "r-delay", 2)
	for deadline := time.Now().Add(10 * time.Second); len(d.rows(t, "r-delay")) < 4; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s the ledger has %d of 4 rows", len(d.rows(t, "r-delay")))
		}
	}
}

// Entries queued while a batch is being appended go in the next one, and Flush waits for
// it too.
func TestLedgerQueuedDuringAppend(t *testing.T) {
	d := openDurable(t, "")
	b := &batches{LedgerStore: d.s, started: make(chan struct{}), hold: make(chan struct{})}
	s := New(b)
	s.persister.delay = time.Millisecond
	decoderEnded(s, "r-a", 1)
	<-b.started // the writer is appending r-a's 2 entries
	decoderEnded(s, "r-b", 3)
	flushed := make(chan struct{})
	go func() { _ = s.Flush(context.Background()); close(flushed) }()
	select {
	case <-flushed:
		t.Fatal("Flush returned while a batch was being appended")
	case <-time.After(50 * time.Millisecond):
	}
	close(b.hold)
	<-flushed
	if got := b.seen(); !slices.Equal(got, []int{2, 6}) {
		t.Fatalf("appends %v, want 2 then 6", got)
	}
	if n := len(d.rows(t, "r-a")) + len(d.rows(t, "r-b")); n != 8 {
		t.Fatalf("%d rows, want 8", n)
	}
}

// counting is a private store that counts the ledger entries appended to it.
type counting struct {
	LedgerStore
	mu      sync.Mutex
	entries int
}

func (c *counting) AddTokens(ctx context.Context, es ...store.LedgerEntry) (int, error) {
	c.mu.Lock()
	c.entries += len(es)
	c.mu.Unlock()
	return c.LedgerStore.AddTokens(ctx, es...)
}

// A private store (memory: nobody outside this process reads it) is not written: the
// decoders keep no token instants for it, as a store-less modelproxy did, and the
// in-memory ledger still has every token for the summaries.
func TestLedgerNotPersistedOnPrivateStore(t *testing.T) {
	st := &counting{LedgerStore: storetest.OpenMemory(t)}
	if st.Shared() {
		t.Fatal("the memory store says it is shared")
	}
	srv := New(st)
	srv.Log = slog.New(slog.DiscardHandler)
	cc := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
	})
	model := modelproxyv1.NewModelProxyServiceClient(cc)
	const run, node = "r-private", "root/m0"
	chunks, err := generate(tenantIdent(run, node), t, model, &modelproxyv1.GenerateRequest{Messages: conversation(fivePlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	flush(t, srv)
	st.mu.Lock()
	n := st.entries
	st.mu.Unlock()
	if n != 0 {
		t.Errorf("the private store got %d ledger entries, want none", n)
	}
	if total, _, _ := srv.Ledger.Figures(run, node, time.Time{}); total != delivered(chunks) || total != 5 {
		t.Errorf("the in-memory ledger has %d tokens, the stream delivered %d, want 5", total, delivered(chunks))
	}
}

// flush is Flush bounded for a test: the entries queued reach the store, or it fails.
func flush(t testing.TB, s *Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Flush(ctx); err != nil {
		t.Error(err)
	}
}

// While the store fails, at most queueMax entries wait; beyond, the oldest are dropped,
// and the newest reach the store once it takes them again.
func TestLedgerQueueBoundedWhileTheStoreFails(t *testing.T) {
	d := openDurable(t, "")
	o := &outage{LedgerStore: d.s}
	o.down.Store(true)
	s := New(o)
	s.Log = slog.New(slog.DiscardHandler)
	s.persister.retryBase = time.Millisecond
	s.persister.queueMax = 4
	const run = "r-bounded"
	decoderEnded(s, run, 3) // 6 entries: root/m0's two are dropped
	for deadline := time.Now().Add(10 * time.Second); o.refused.Load() < 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the writer never tried the failing store")
		}
	}
	o.down.Store(false)
	flush(t, s)
	u := d.usage(t, run)
	if u.ByNode["root/m0"] != 0 || u.ByNode["root/m1"] != 4 || u.ByNode["root/m2"] != 4 {
		t.Fatalf("usage by node %v: want root/m0's entries dropped, m1's and m2's 4 tokens each", u.ByNode)
	}
}

// Entries dropped over the bound while their batch was being appended are not taken off
// the queue twice: the entries queued after them still reach the store.
func TestLedgerBoundDuringAppendKeepsTheNewest(t *testing.T) {
	d := openDurable(t, "")
	b := &batches{LedgerStore: d.s, started: make(chan struct{}), hold: make(chan struct{})}
	s := New(b)
	s.Log = slog.New(slog.DiscardHandler)
	s.persister.delay = time.Millisecond
	s.persister.queueMax = 4
	decoderEnded(s, "r-a", 1)
	<-b.started               // the writer is appending r-a's 2 entries
	decoderEnded(s, "r-b", 2) // 6 queued: r-a's 2, in flight, are over the bound
	close(b.hold)
	flush(t, s)
	if got := b.seen(); !slices.Equal(got, []int{2, 4}) {
		t.Fatalf("appends %v, want 2 then r-b's 4", got)
	}
	if n := len(d.rows(t, "r-b")); n != 4 {
		t.Fatalf("r-b has %d rows, want its 4", n)
	}
}
