package modelproxy

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// LedgerStore persists token spend: the append half of store.Ledger, and whether the
// store is shared. A store.Store (memory, sqlite or postgres) is one.
//
// Only a shared store is written: the durable ledger is for readers outside this process
// (`curfew trace`, other replicas, audits), and a private memory store has none, while the
// in-memory Ledger serves this process's own summaries. Keeping each token's instant costs
// the decoders CPU at a cancel, so a private store skips it.
type LedgerStore interface {
	AddTokens(ctx context.Context, es ...store.LedgerEntry) (added int, err error)
	store.Sharing
}

// Kinds of the entries a decoder appends to the durable ledger.
const (
	// KindOutput counts the tokens a decoder emitted before its context was cancelled
	// (all of them when it was not).
	KindOutput = "output"
	// KindOrphan counts the tokens a decoder emitted after its context was cancelled.
	KindOrphan = "orphan"
)

// persistTimeout bounds one batch's append to the store.
const persistTimeout = 2 * time.Second

// persistDelay is how long entries gather before the writer appends them: decoders that
// end together (a cancelled tree) end within a few milliseconds of each other, and their
// entries then cost one transaction after the burst instead of one each during it, when
// the CPU is better spent stopping the other decoders. It is also the longest an entry
// waits in memory, and so what a killed modelproxy can lose beyond the appends in flight.
const persistDelay = 20 * time.Millisecond

// persistBatch bounds the entries appended in one transaction.
const persistBatch = 512

// spendCheckpoint is how often a streaming decoder's tokens are queued for the durable
// ledger: a decoder queues the tokens recorded since its last part at its first token
// after each interval, and the rest when it ends. A modelproxy killed mid-stream so loses
// at most this interval of a decoder's spend (plus persistDelay), not the whole decode.
const spendCheckpoint = 500 * time.Millisecond

// spend is one decoder's share of the ledger: it records each token into the server's
// in-memory Ledger and, when the server persists (a shared store), keeps the token's
// instant and the instant the decoder's context was cancelled, and queues the decoder's
// tokens for the store in parts: one every spendCheckpoint while it streams, and the
// last when it ends. Tokens of a decoder are recorded by its own goroutine only.
type spend struct {
	srv       *Server
	ctx       context.Context // the call's: its identity names the entries
	run, node string          // the in-memory ledger's key
	keep      bool            // persisted: keep the instants
	at        []int64         // unix nanos of the decoder's tokens
	prompted  int64           // prompt tokens charged
	spent     int64           // output and prompt tokens recorded, persisted or not (the budget's settle)
	cancelled atomic.Int64
	// output counts the output tokens recorded so far, for readers on other goroutines
	// (ListDecoders).
	output atomic.Int64
	done   chan struct{} // closed once the cancel instant is stored
	stop   func() bool

	// The parts for the durable ledger (keep and a run id).
	prun     string    // the run the entries are attributed to; "": nothing is persisted
	key      string    // the decoder's ledger key; part k is key/k
	provider string    // the provider of the latest tokens
	parts    int       // parts queued
	queued   int       // instants of at queued so far
	prompts  int64     // prompt tokens queued so far
	last     time.Time // when the last part was queued, or the decoder started
}

// newSpend starts the tally of a decoder whose node context is ctx, keyed run and node in
// the in-memory ledger and attributed to prun in the store under key (decoderKey; "" for
// a call without a run id: not persisted).
func (s *Server) newSpend(ctx context.Context, run, node, prun, key string) *spend {
	d := &spend{srv: s, ctx: ctx, run: run, node: node, keep: s.Store.Shared(), prun: prun, last: s.now()}
	if d.keep {
		d.done = make(chan struct{})
		d.stop = context.AfterFunc(ctx, func() {
			d.cancelled.Store(s.now().UnixNano())
			close(d.done)
		})
		d.key = key
	}
	return d
}

// decoderKey is the key of the parts a decoder of node attributed to prun will persist
// (ledgerEntryKey), or "" when none will be: the store is private, or the call has no
// run id. It is made before the call's budget reservation, which records it, so that a
// hold this process never settles is charged the parts when it lapses (budget.WithLedger).
func (s *Server) decoderKey(ctx context.Context, prun, node string) string {
	if !s.Store.Shared() || prun == "" {
		return ""
	}
	return s.ledgerEntryKey(ctx, prun, node)
}

// record adds n tokens emitted at instant at by provider, and queues a part for the
// store when the last is spendCheckpoint old.
func (d *spend) record(at time.Time, n int, provider string) {
	if n <= 0 {
		return
	}
	d.spent += int64(n)
	d.output.Add(int64(n))
	d.ledger().RecordN(d.run, d.node, at, n)
	if !d.keep {
		return
	}
	ns := at.UnixNano()
	for range n {
		d.at = append(d.at, ns)
	}
	d.provider = provider
	if d.key != "" {
		if now := d.srv.now(); now.Sub(d.last) >= d.srv.checkpoint {
			d.checkpoint(now)
		}
	}
}

func (d *spend) ledger() *Ledger { return d.srv.Ledger }

// prompt adds the n prompt tokens the provider charged the decoder's request.
func (d *spend) prompt(n int64) {
	if n <= 0 {
		return
	}
	d.spent += n
	d.ledger().RecordPrompt(d.run, d.node, n)
	if d.keep {
		d.prompted += n
	}
}

// checkpoint queues the tokens recorded since the last part while the decoder streams.
// Its split of output from orphan tokens needs the cancel's instant: while the context is
// done but the instant not yet stored, it waits for the end instead.
func (d *spend) checkpoint(now time.Time) {
	var c int64
	select {
	case <-d.done:
		c = d.cancelled.Load()
	default:
		if d.ctx.Err() != nil {
			return
		}
		// Not cancelled now: every token recorded so far precedes any later cancel.
	}
	d.queue(c)
	d.last = now
}

// end stops watching the context, queues the decoder's last part for the store (it
// is attributed to the provider that decoded, provider), and returns the decoder's
// tokens in all, split at the instant its context was cancelled (all of them are output
// when it was not), and the prompt tokens it was charged. Without a shared store it
// returns nothing: nothing is persisted.
func (d *spend) end(provider string) (output, orphan, prompt int64) {
	if !d.keep {
		return 0, 0, 0
	}
	if !d.stop() {
		<-d.done // the cancel fired: wait until its instant is stored
	}
	c := d.cancelled.Load()
	if provider != "" {
		d.provider = provider
	}
	if d.key != "" {
		d.queue(c)
	}
	for _, t := range d.at {
		if c != 0 && t > c {
			orphan++
		}
	}
	return int64(len(d.at)) - orphan, orphan, d.prompted
}

// queue queues the part of the tokens and prompt tokens not queued yet, split at the
// cancel instant c (0: not cancelled): an "output" entry with the tokens before it, an
// "orphan" entry with those after, and a "prompt" entry (store.KindPrompt), each only
// when non-zero, under the key key/k of the decoder's k-th part.
func (d *spend) queue(c int64) {
	var output, orphan int64
	for _, t := range d.at[d.queued:] {
		if c != 0 && t > c {
			orphan++
		} else {
			output++
		}
	}
	prompt := d.prompted - d.prompts
	if output == 0 && orphan == 0 && prompt == 0 {
		return
	}
	d.queued, d.prompts = len(d.at), d.prompted
	d.parts++
	id := md.IdentityFrom(d.ctx)
	tenant := id.Tenant
	if tenant == "" {
		tenant = md.DefaultTenant
	}
	key := d.key + "/" + strconv.Itoa(d.parts)
	entry := func(kind, key string, n int64) store.LedgerEntry {
		return store.LedgerEntry{Tenant: tenant, RunID: d.prun, NodeID: d.node, Tokens: n, Kind: kind, Key: key,
			RetryID: id.RetryID, Provider: d.provider}
	}
	entries := make([]store.LedgerEntry, 0, 3)
	if output > 0 {
		entries = append(entries, entry(KindOutput, key, output))
	}
	if orphan > 0 {
		entries = append(entries, entry(KindOrphan, key+"/"+KindOrphan, orphan))
	}
	if prompt > 0 {
		entries = append(entries, entry(store.KindPrompt, key+"/"+store.KindPrompt, prompt))
	}
	d.srv.enqueue(d.ctx, entries...)
}

// ledgerEntryKey is the key of a decoder of node attributed to run in the durable ledger.
// run/node/retry-id/attempt name the decoder for whoever reads the ledger; the process
// nonce and the sequence make the key unique to this decoder, so a step decoded again (by
// a retry or after an orchestrator restart) is new entries, while an append of an entry
// repeated (after a failed transaction) is not counted twice.
func (s *Server) ledgerEntryKey(ctx context.Context, run, node string) string {
	id := md.IdentityFrom(ctx)
	retry := id.RetryID
	if retry == "" {
		retry = "-"
	}
	p := &s.persister
	return fmt.Sprintf("modelproxy/%s/%s/%s/%d/%s.%d", run, node, retry, max(id.Attempt, 1), p.nonce, p.seq.Add(1))
}

// LedgerWriter returns this process's mark in the keys of the ledger entries it appends
// (ledgerEntryKey: …/<writer>.<seq>/<kind>): random per process, so the entries one
// modelproxy process appended can be told from another's, for instance to check them
// against that process's own counters.
func (s *Server) LedgerWriter() string { return s.persister.nonce }

// LedgerWriterCollector exports LedgerWriter as the info metric
// curfew_modelproxy_ledger_writer_info{writer="…"} 1.
func (s *Server) LedgerWriterCollector() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "curfew_modelproxy_ledger_writer_info",
		Help:        "This modelproxy process's mark in the keys of the token ledger entries it appends (…/<writer>.<sequence>/<kind>), random per process: the entries one process appended are those whose key carries its writer.",
		ConstLabels: prometheus.Labels{"writer": s.persister.nonce},
	})
	g.Set(1)
	return g
}

// persister queues decoders' ledger entries and appends them to the store off the
// calls' path: one writer goroutine, started by the first entry queued while none runs,
// waits persistDelay, appends what has queued (at most persistBatch) in one transaction,
// and ends when the queue is empty.
//
// An append that fails (the store restarting, unreachable) is not lost: its entries go
// back to the head of the queue and the writer tries again after a backoff (from
// persistDelay doubling to persistRetryMax), until the store takes them. Their keys make
// a repeated append count once. The queue holds at most persistQueueMax entries; beyond,
// the oldest are dropped and logged as lost.
type persister struct {
	nonce string        // random per process: keys of a restarted modelproxy never collide
	seq   atomic.Uint64 // per decoder

	mu        sync.Mutex
	queue     []store.LedgerEntry
	running   bool          // the writer is running
	delay     time.Duration // persistDelay; tests may change it
	waiters   int           // Flush calls waiting: the writer does not delay
	hurry     chan struct{} // wakes a delaying writer for Flush (capacity 1)
	idle      sync.Cond     // on mu, broadcast when the writer ends or gives up an attempt
	abandon   bool          // a Flush ran out of time: the writer drops what is queued and ends
	failing   time.Time     // since when appends fail; zero while they succeed
	dropped   int64         // entries dropped over persistQueueMax since the last log line
	shed      uint64        // entries ever dropped from the queue's head over the bound
	queueMax  int           // persistQueueMax; tests may change it
	retryBase time.Duration // the first retry's backoff: persistDelay; tests may change it
}

// persistRetryMax bounds the backoff between appends retried while the store fails.
const persistRetryMax = 2 * time.Second

// persistQueueMax bounds the entries waiting for the store (about 200 bytes each): a
// store down for long costs memory up to this, then the oldest entries.
const persistQueueMax = 200_000

// enqueue queues es and starts the writer unless it runs. ctx is the queuing call's,
// detached from its cancellation for the writer.
func (s *Server) enqueue(ctx context.Context, es ...store.LedgerEntry) {
	p := &s.persister
	p.mu.Lock()
	defer p.mu.Unlock()
	p.queue = append(p.queue, es...)
	if over := len(p.queue) - p.max(); over > 0 {
		p.queue = p.queue[over:]
		p.dropped += int64(over)
		p.shed += uint64(over)
	}
	if p.running {
		return
	}
	p.running = true
	p.init()
	go s.write(context.WithoutCancel(ctx))
}

// init makes what a zero persister lacks; p.mu is held.
func (p *persister) init() {
	if p.idle.L == nil {
		p.idle.L = &p.mu
		p.hurry = make(chan struct{}, 1)
	}
}

func (p *persister) max() int {
	if p.queueMax > 0 {
		return p.queueMax
	}
	return persistQueueMax
}

// write is the writer: it appends the queue in batches until it is empty.
func (s *Server) write(ctx context.Context) {
	p := &s.persister
	var backoff time.Duration // while appends fail
	for {
		p.mu.Lock()
		wait := p.delay
		if p.waiters > 0 {
			wait = 0
		}
		if backoff > 0 {
			wait = backoff
		}
		p.mu.Unlock()
		if wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-p.hurry:
				t.Stop()
			}
		}
		p.mu.Lock()
		if p.abandon {
			s.lost(p.queue, "the store did not take them before the flush's bound")
			p.queue = nil
		}
		batch := p.queue
		if len(batch) > persistBatch {
			batch = batch[:persistBatch:persistBatch]
		}
		shed := p.shed
		p.mu.Unlock()

		var err error
		if len(batch) > 0 {
			err = s.append(ctx, batch)
		}

		p.mu.Lock()
		if p.dropped > 0 {
			s.log().Error("token ledger: too many entries waiting for the store; the oldest were dropped",
				"entries", p.dropped, "queue_max", p.max())
			p.dropped = 0
		}
		switch {
		case err != nil && retriable(err) && !p.abandon:
			if p.failing.IsZero() {
				p.failing = time.Now()
				s.log().Warn("token ledger entries not persisted yet: retrying until the store takes them",
					"entries", len(p.queue), "error", err.Error())
			}
			backoff = min(max(2*backoff, p.retryFirst()), persistRetryMax)
			p.idle.Broadcast() // a Flush may be waiting to give up
		case err != nil:
			s.lost(batch, err.Error())
			fallthrough
		default:
			if !p.failing.IsZero() && err == nil && len(batch) > 0 {
				s.log().Info("token ledger: the store takes entries again", "failed_for", time.Since(p.failing).Round(time.Millisecond).String())
				p.failing = time.Time{}
			}
			backoff = 0
			// The batch was the queue's head: entries are added at its tail only, and
			// dropped from its head only beyond the bound, maybe some of the batch's while
			// it was appended. What is left of it goes.
			left := max(len(batch)-int(p.shed-shed), 0) //nolint:gosec // at most the queue's length
			p.queue = p.queue[min(left, len(p.queue)):]
		}
		if len(p.queue) == 0 {
			p.queue = nil // let the appended entries go
			p.running = false
			select { // a Flush's wake-up that came while appending: not the next writer's
			case <-p.hurry:
			default:
			}
			p.idle.Broadcast()
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
	}
}

func (p *persister) retryFirst() time.Duration {
	if p.retryBase > 0 {
		return p.retryBase
	}
	return persistDelay
}

// retriable reports whether an append that failed with err may succeed later: every
// failure but an entry the store refuses (store.ErrInvalidArgument).
func retriable(err error) bool { return !errors.Is(err, store.ErrInvalidArgument) }

// append writes batch in one transaction, bounded by persistTimeout.
func (s *Server) append(ctx context.Context, batch []store.LedgerEntry) error {
	ctx, cancel := context.WithTimeout(ctx, persistTimeout)
	defer cancel()
	_, err := s.Store.AddTokens(ctx, batch...)
	return err
}

// lost logs entries given up on, and why.
func (s *Server) lost(batch []store.LedgerEntry, why string) {
	if len(batch) == 0 {
		return
	}
	var tokens int64
	var runs []string
	for _, e := range batch {
		tokens += e.Tokens
		if len(runs) < 8 && !slices.Contains(runs, e.RunID) {
			runs = append(runs, e.RunID)
		}
	}
	s.log().Error("token ledger entries lost", "entries", len(batch), "tokens", tokens,
		"runs", runs, "first_key", batch[0].Key, "why", why)
}

// newNonce returns the random part of this process's ledger keys.
func newNonce() string { return rand.Text()[:12] }

// Flush appends the queued ledger entries without delay and returns once none is queued
// or being appended: call it before closing the store. While the store fails, the
// appends are retried until ctx is done; then what is still queued is dropped, logged,
// and counted in the error.
func (s *Server) Flush(ctx context.Context) error {
	p := &s.persister
	p.mu.Lock()
	defer p.mu.Unlock()
	p.init()
	p.waiters++
	defer func() { p.waiters-- }()
	wake := func() {
		select {
		case p.hurry <- struct{}{}:
		default:
		}
	}
	if p.running {
		wake()
	}
	stop := context.AfterFunc(ctx, func() {
		p.mu.Lock()
		p.idle.Broadcast()
		p.mu.Unlock()
	})
	defer stop()
	var lost int
	for p.running {
		if ctx.Err() != nil && !p.abandon {
			p.abandon, lost = true, len(p.queue)
			wake()
		}
		p.idle.Wait()
	}
	p.abandon = false
	if lost > 0 {
		return fmt.Errorf("token ledger: %d entries not persisted: %w", lost, context.Cause(ctx))
	}
	return nil
}

func (s *Server) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}
