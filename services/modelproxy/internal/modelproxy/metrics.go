package modelproxy

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// SimProvider is the provider label of tokens the built-in sim decoder emitted.
const SimProvider = "sim"

// Metrics are modelproxy's token metrics. The labels are bounded: model is the name a
// caller asked for, which is sim or a configured alias (any other is refused before a
// decoder starts), and provider is sim or a configured provider.
type Metrics struct {
	tokens  *prometheus.CounterVec
	prompt  *prometheus.CounterVec
	orphans *prometheus.CounterVec

	mu      sync.Mutex
	handles map[[2]string]prometheus.Counter // tokens, by model and provider
}

// NewMetrics returns the metrics, registered with reg when not nil. The sim model's
// series start at 0.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_model_tokens_total",
			Help: "Output tokens decoders emitted, as the token ledger recorded them, by model (sim or an alias) and the provider that decoded them.",
		}, []string{"model", "provider"}),
		prompt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_model_prompt_tokens_total",
			Help: "Prompt (input) tokens decoders were charged, as the provider's usage reported them (the sim model counts one per word of the request's messages), by model and provider.",
		}, []string{"model", "provider"}),
		orphans: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_model_orphan_tokens_total",
			Help: "Output tokens emitted after the run's cancel instant (tokens_after_cancel), by model and provider; counted once per node when the run's summary is assembled. Should stay at 0.",
		}, []string{"model", "provider"}),
		handles: map[[2]string]prometheus.Counter{},
	}
	m.tokens.WithLabelValues(SimModel, SimProvider)
	m.prompt.WithLabelValues(SimModel, SimProvider)
	m.orphans.WithLabelValues(SimModel, SimProvider)
	if reg != nil {
		reg.MustRegister(m.tokens, m.prompt, m.orphans)
	}
	return m
}

// counter returns the token counter of model and provider, nil when m is nil.
func (m *Metrics) counter(model, provider string) prometheus.Counter {
	if m == nil {
		return nil
	}
	k := [2]string{model, provider}
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.handles[k]
	if c == nil {
		c = m.tokens.WithLabelValues(model, provider)
		m.handles[k] = c
	}
	return c
}

// addTokens counts n tokens of model decoded by provider.
func (m *Metrics) addTokens(model, provider string, n int) {
	if c := m.counter(model, provider); c != nil && n > 0 {
		c.Add(float64(n))
	}
}

// addPrompt counts n prompt tokens of model charged by provider.
func (m *Metrics) addPrompt(model, provider string, n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.prompt.WithLabelValues(model, provider).Add(float64(n))
}

// summarized counts a decoder node's orphan tokens once the run's summary lists it.
func (m *Metrics) summarized(_ string, n *meshv1.Node) {
	if m == nil || n.GetTokensAfterCancel() <= 0 {
		return
	}
	p := n.GetProvider()
	if p == "" {
		p = SimProvider
	}
	m.orphans.WithLabelValues(n.GetName(), p).Add(float64(n.GetTokensAfterCancel()))
}
