package modelproxy

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// LedgerStore persists token spend: the append half of store.Ledger. A *store.Store
// (sqlite or postgres) is one.
type LedgerStore interface {
	AddTokens(ctx context.Context, e store.LedgerEntry) (added bool, err error)
}

// Kinds of the entries a decoder appends to the durable ledger.
const (
	// KindOutput counts the tokens a decoder emitted before its context was cancelled
	// (all of them when it was not).
	KindOutput = "output"
	// KindOrphan counts the tokens a decoder emitted after its context was cancelled.
	KindOrphan = "orphan"
)

// persistTimeout bounds one decoder's append to the store.
const persistTimeout = 2 * time.Second

// spend is one decoder's share of the ledger: it records each token into the server's
// in-memory Ledger and, when the server persists, keeps the token's instant and the
// instant the decoder's context was cancelled, so that the decoder's own tokens can be
// appended to the store when it ends. Tokens of a decoder are recorded by its own
// goroutine only.
type spend struct {
	ledger    *Ledger
	run, node string
	keep      bool    // persisted: keep the instants
	at        []int64 // unix nanos of the decoder's tokens
	cancelled atomic.Int64
	done      chan struct{} // closed once the cancel instant is stored
	stop      func() bool
}

// newSpend starts the tally of a decoder whose node context is ctx.
func (s *Server) newSpend(ctx context.Context, run, node string) *spend {
	d := &spend{ledger: s.Ledger, run: run, node: node, keep: s.Store != nil}
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
	d.ledger.RecordN(d.run, d.node, at, n)
	if d.keep {
		ns := at.UnixNano()
		for range n {
			d.at = append(d.at, ns)
		}
	}
}

// end stops watching the context and returns the decoder's tokens split at the instant
// its context was cancelled: all of them are output when it was not.
func (d *spend) end() (output, orphan int64) {
	if !d.keep {
		return 0, 0
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
	return int64(len(d.at)) - orphan, orphan
}

// persister appends decoders' ledger entries to the store off the call's path.
type persister struct {
	nonce string        // random per process: keys of a restarted modelproxy never collide
	seq   atomic.Uint64 // per decoder

	mu       sync.Mutex
	inflight int
	idle     sync.Cond // on mu, broadcast when inflight drops to 0
}

// start counts an append in flight; done ends it. Unlike a WaitGroup's Add, start may
// race with Flush (a call still ending after a forced shutdown).
func (p *persister) start() {
	p.mu.Lock()
	p.inflight++
	p.mu.Unlock()
}

func (p *persister) done() {
	p.mu.Lock()
	if p.inflight--; p.inflight == 0 && p.idle.L != nil {
		p.idle.Broadcast()
	}
	p.mu.Unlock()
}

// wait returns once no append is in flight.
func (p *persister) wait() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.idle.L == nil {
		p.idle.L = &p.mu
	}
	for p.inflight > 0 {
		p.idle.Wait()
	}
}

// newNonce returns the random part of this process's ledger keys.
func newNonce() string { return rand.Text()[:12] }

// persist appends the entries of a decoder of node that just ended, attributed to the
// call's tenant, run, node and retry-id and to the provider that decoded (its figures from
// spend.end): one "output" entry with the tokens it emitted before a cancel, and one
// "orphan" entry with those after, each only when non-zero, and nothing for a call
// without a run id. The append runs in its own goroutine on ctx detached from the call's
// cancellation, bounded by persistTimeout, so the caller's stream ends without waiting
// for it; a failure is logged. Flush waits for the appends in flight.
func (s *Server) persist(ctx context.Context, node, provider string, output, orphan int64) {
	if s.Store == nil || (output == 0 && orphan == 0) {
		return
	}
	id := md.IdentityFrom(ctx)
	if id.RunID == "" {
		return
	}
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
	entries := make([]store.LedgerEntry, 0, 2)
	if output > 0 {
		entries = append(entries, store.LedgerEntry{Tenant: tenant, RunID: id.RunID, NodeID: node, Tokens: output, Kind: KindOutput, Key: key,
			RetryID: id.RetryID, Provider: provider})
	}
	if orphan > 0 {
		entries = append(entries, store.LedgerEntry{Tenant: tenant, RunID: id.RunID, NodeID: node, Tokens: orphan, Kind: KindOrphan, Key: key + "/" + KindOrphan,
			RetryID: id.RetryID, Provider: provider})
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), persistTimeout)
	p.start()
	go func() {
		defer p.done()
		defer cancel()
		for _, e := range entries {
			if _, err := s.Store.AddTokens(wctx, e); err != nil {
				s.log().Warn("token ledger entry not persisted", "run", e.RunID, "node", e.NodeID,
					"kind", e.Kind, "tokens", e.Tokens, "key", e.Key, "error", err.Error())
			}
		}
	}()
}

// Flush waits for the ledger entries being appended to the store. Call it before closing
// the store.
func (s *Server) Flush() { s.persister.wait() }

func (s *Server) log() *slog.Logger {
	if s.Log != nil {
		return s.Log
	}
	return slog.Default()
}
