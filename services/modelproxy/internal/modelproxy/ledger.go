package modelproxy

import (
	"sync"
	"time"
)

// Ledger records the instant of every token a decoder emitted, and the prompt (input)
// tokens its decoders were charged, by run and node.
type Ledger struct {
	mu     sync.Mutex
	runs   map[string]map[string][]int64 // run → node → unix nanos, in emission order
	prompt map[string]map[string]int64   // run → node → prompt tokens
}

// NewLedger returns an empty ledger.
func NewLedger() *Ledger {
	return &Ledger{runs: make(map[string]map[string][]int64), prompt: make(map[string]map[string]int64)}
}

// RecordPrompt adds n prompt tokens charged to the node.
func (l *Ledger) RecordPrompt(run, node string, n int64) {
	if n <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.prompt[run]
	if m == nil {
		m = make(map[string]int64)
		l.prompt[run] = m
	}
	m[node] += n
}

// Prompt returns the prompt tokens charged to the node.
func (l *Ledger) Prompt(run, node string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.prompt[run][node]
}

// Record adds one token emitted at instant at.
func (l *Ledger) Record(run, node string, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.runs[run]
	if m == nil {
		m = make(map[string][]int64)
		l.runs[run] = m
	}
	m[node] = append(m[node], at.UnixNano())
}

// RecordN adds n tokens emitted at instant at.
func (l *Ledger) RecordN(run, node string, at time.Time, n int) {
	if n <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.runs[run]
	if m == nil {
		m = make(map[string][]int64)
		l.runs[run] = m
	}
	for range n {
		m[node] = append(m[node], at.UnixNano())
	}
}

// Figures returns the node's token count, and its split at cancelAt (all tokens count as
// before when cancelAt is zero).
func (l *Ledger) Figures(run, node string, cancelAt time.Time) (total, before, after int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ts := l.runs[run][node]
	total = int64(len(ts))
	if cancelAt.IsZero() {
		return total, total, 0
	}
	// Count rather than binary-search: two decoders of the same node (a retry racing the
	// attempt it supersedes) may interleave their instants.
	c := cancelAt.UnixNano()
	for _, t := range ts {
		if t > c {
			after++
		}
	}
	return total, total - after, after
}

// Forget drops a run's records.
func (l *Ledger) Forget(run string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.runs, run)
	delete(l.prompt, run)
}

// Runs returns the runs the ledger holds.
func (l *Ledger) Runs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, 0, len(l.runs)+len(l.prompt))
	for r := range l.runs {
		out = append(out, r)
	}
	for r := range l.prompt {
		if _, ok := l.runs[r]; !ok {
			out = append(out, r)
		}
	}
	return out
}
