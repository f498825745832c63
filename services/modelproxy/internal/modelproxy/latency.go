package modelproxy

import (
	"slices"
	"sync"
	"time"
)

// latencyWindow is how many recent calls of a provider the expectation is taken from.
const latencyWindow = 64

// minObserved is how many observations replace a provider's declared estimate.
const minObserved = 5

// latency tracks a provider's recent time to first token and time per output token.
type latency struct {
	mu       sync.Mutex
	ttft     []time.Duration // ring of the last latencyWindow
	perToken []time.Duration
	nTTFT    int
	nTok     int
	// declared estimates, used until minObserved observations
	declTTFT     time.Duration
	declPerToken time.Duration
}

func newLatency(ttft time.Duration, tps float64) *latency {
	l := &latency{declTTFT: ttft}
	if tps > 0 {
		l.declPerToken = time.Duration(float64(time.Second) / tps)
	}
	return l
}

func push(ring []time.Duration, n int, d time.Duration) []time.Duration {
	if len(ring) < latencyWindow {
		return append(ring, d)
	}
	ring[n%latencyWindow] = d
	return ring
}

// observe records a completed call: its time to first token and, when it emitted more
// than one token, its time per token after the first.
func (l *latency) observe(ttft time.Duration, tokens int, decode time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ttft = push(l.ttft, l.nTTFT, ttft)
	l.nTTFT++
	if tokens > 1 && decode > 0 {
		l.perToken = push(l.perToken, l.nTok, decode/time.Duration(tokens-1))
		l.nTok++
	}
}

// expected returns the q-quantile time to first token and per token, from observations
// once there are enough, else from the declared estimates. Zero means unknown.
func (l *latency) expected(q float64) (ttft, perToken time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ttft, perToken = l.declTTFT, l.declPerToken
	if len(l.ttft) >= minObserved {
		ttft = quantile(l.ttft, q)
	}
	if len(l.perToken) >= minObserved {
		perToken = quantile(l.perToken, q)
	}
	return ttft, perToken
}

func quantile(xs []time.Duration, q float64) time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(q * float64(len(s)))
	if i >= len(s) {
		i = len(s) - 1
	}
	return s[i]
}
