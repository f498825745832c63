package modelproxy

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

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

// spend is one decoder's share of the ledger: it records each token into the server's
// in-memory Ledger and, when the server persists (a shared store), keeps the token's
// instant and the instant the decoder's context was cancelled, so that the decoder's own
// tokens can be appended to the store when it ends. Tokens of a decoder are recorded by
// its own goroutine only.
type spend struct {
	ledger    *Ledger
	run, node string
	keep      bool    // persisted: keep the instants
	at        []int64 // unix nanos of the decoder's tokens
	prompted  int64   // prompt tokens charged
	spent     int64   // output and prompt tokens recorded, persisted or not (the budget's settle)
	cancelled atomic.Int64
	// output counts the output tokens recorded so far, for readers on other goroutines
	// (ListDecoders).
	output atomic.Int64
	done   chan struct{} // closed once the cancel instant is stored
	stop   func() bool
}

// newSpend starts the tally of a decoder whose node context is ctx.
func (s *Server) newSpend(ctx context.Context, run, node string) *spend {
	d := &spend{ledger: s.Ledger, run: run, node: node, keep: s.Store.Shared()}
	if d.keep {
		d.done = make(chan struct{})
		d.stop = context.AfterFunc(ctx, func() {
			d.cancelled.Store(s.now().UnixNano())
			close(d.done)
		})
	}
	return d
}

// record adds n tokens emitted at instant at.
func (d *spend) record(at time.Time, n int) {
	if n <= 0 {
		return
	}
	d.spent += int64(n)
	d.output.Add(int64(n))
	d.ledger.RecordN(d.run, d.node, at, n)
	if d.keep {
		ns := at.UnixNano()
		for range n {
			d.at = append(d.at, ns)
		}
	}
}

// prompt adds the n prompt tokens the provider charged the decoder's request.
func (d *spend) prompt(n int64) {
	if n <= 0 {
		return
	}
	d.spent += n
	d.ledger.RecordPrompt(d.run, d.node, n)
	if d.keep {
		d.prompted += n
	}
}

// end stops watching the context and returns the decoder's tokens split at the instant
// its context was cancelled (all of them are output when it was not), and the prompt
// tokens it was charged. Without a shared store it returns nothing: nothing is persisted.
func (d *spend) end() (output, orphan, prompt int64) {
	if !d.keep {
		return 0, 0, 0
	}
	if !d.stop() {
		<-d.done // the cancel fired: wait until its instant is stored
	}
	c := d.cancelled.Load()
	for _, t := range d.at {
		if c != 0 && t > c {
			orphan++
		}
	}
	return int64(len(d.at)) - orphan, orphan, d.prompted
}

// persister queues decoders' ledger entries and appends them to the store off the
// calls' path: one writer goroutine, started by the first entry queued while none runs,
// waits persistDelay, appends what has queued (at most persistBatch) in one transaction,
// and ends when the queue is empty.
type persister struct {
	nonce string        // random per process: keys of a restarted modelproxy never collide
	seq   atomic.Uint64 // per decoder

	mu      sync.Mutex
	queue   []store.LedgerEntry
	running bool          // the writer is running
	delay   time.Duration // persistDelay; tests may change it
	waiters int           // Flush calls waiting: the writer does not delay
	hurry   chan struct{} // wakes a delaying writer for Flush (capacity 1)
	idle    sync.Cond     // on mu, broadcast when the writer ends
}

// enqueue queues es and starts the writer unless it runs. ctx is the queuing call's,
// detached from its cancellation for the writer.
func (s *Server) enqueue(ctx context.Context, es ...store.LedgerEntry) {
	p := &s.persister
	p.mu.Lock()
	defer p.mu.Unlock()
	p.queue = append(p.queue, es...)
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

// write is the writer: it appends the queue in batches until it is empty.
func (s *Server) write(ctx context.Context) {
	p := &s.persister
	for {
		p.mu.Lock()
		hurry := p.waiters > 0
		p.mu.Unlock()
		if !hurry {
			t := time.NewTimer(p.delay)
			select {
			case <-t.C:
			case <-p.hurry:
				t.Stop()
			}
		}
		p.mu.Lock()
		batch := p.queue
		if len(batch) > persistBatch {
			batch = batch[:persistBatch:persistBatch]
		}
		p.queue = p.queue[len(batch):]
		p.mu.Unlock()

		s.append(ctx, batch)

		p.mu.Lock()
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

// append writes batch in one transaction, bounded by persistTimeout; a failure is logged
// (the in-memory ledger still has the tokens).
func (s *Server) append(ctx context.Context, batch []store.LedgerEntry) {
	ctx, cancel := context.WithTimeout(ctx, persistTimeout)
	defer cancel()
	if _, err := s.Store.AddTokens(ctx, batch...); err != nil {
		var tokens int64
		var runs []string
		for _, e := range batch {
			tokens += e.Tokens
			if len(runs) < 8 && !slices.Contains(runs, e.RunID) {
				runs = append(runs, e.RunID)
			}
		}
		s.log().Warn("token ledger entries not persisted", "entries", len(batch), "tokens", tokens,
			"runs", runs, "first_key", batch[0].Key, "error", err.Error())
	}
}

// newNonce returns the random part of this process's ledger keys.
func newNonce() string { return rand.Text()[:12] }

// persist queues the entries of a decoder of node that just ended, attributed to run
// (the ledger's key of the call's run id), the call's tenant and retry-id, and the
// provider that decoded (its figures from spend.end): one "output" entry with the tokens
// it emitted before a cancel, one "orphan" entry with those after, and one "prompt"
// entry (store.KindPrompt) with the prompt tokens it was charged, each only when
// non-zero, and nothing for a call without a run id. The entries are queued for the
// writer (persister), so the caller's stream ends without waiting for the store; a
// failure is logged. Flush appends what is queued.
func (s *Server) persist(ctx context.Context, run, node, provider string, output, orphan, prompt int64) {
	if (output == 0 && orphan == 0 && prompt == 0) || run == "" {
		return
	}
	id := md.IdentityFrom(ctx)
	id.RunID = run
	tenant := id.Tenant
	if tenant == "" {
		tenant = md.DefaultTenant
	}
	p := &s.persister
	retry := id.RetryID
	if retry == "" {
		retry = "-"
	}
	// run/node/retry-id/attempt name the decoder for whoever reads the ledger; the
	// process nonce and the sequence make the key unique to this decoder, so a step
	// decoded again (by a retry or after an orchestrator restart) is a new entry, while an
	// append of this entry repeated is not counted twice.
	key := fmt.Sprintf("modelproxy/%s/%s/%s/%d/%s.%d", id.RunID, node, retry, max(id.Attempt, 1), p.nonce, p.seq.Add(1))
	entries := make([]store.LedgerEntry, 0, 3)
	if output > 0 {
		entries = append(entries, store.LedgerEntry{Tenant: tenant, RunID: id.RunID, NodeID: node, Tokens: output, Kind: KindOutput, Key: key,
			RetryID: id.RetryID, Provider: provider})
	}
	if orphan > 0 {
		entries = append(entries, store.LedgerEntry{Tenant: tenant, RunID: id.RunID, NodeID: node, Tokens: orphan, Kind: KindOrphan, Key: key + "/" + KindOrphan,
			RetryID: id.RetryID, Provider: provider})
	}
	if prompt > 0 {
		entries = append(entries, store.LedgerEntry{Tenant: tenant, RunID: id.RunID, NodeID: node, Tokens: prompt, Kind: store.KindPrompt, Key: key + "/" + store.KindPrompt,
			RetryID: id.RetryID, Provider: provider})
	}
	s.enqueue(ctx, entries...)
}

// Flush appends the queued ledger entries without delay and returns once none is queued
// or being appended. Call it before closing the store.
func (s *Server) Flush() {
	p := &s.persister
	p.mu.Lock()
	defer p.mu.Unlock()
	p.init()
	p.waiters++
	if p.running {
		select {
		case p.hurry <- struct{}{}:
		default:
		}
	}
	for p.running {
		p.idle.Wait()
	}
	p.waiters--
}

func (s *Server) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}
