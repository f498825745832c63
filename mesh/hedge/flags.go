package hedge

import (
	"flag"

	"github.com/prometheus/client_golang/prometheus"
)

// Flags are the hedging flags of the services that run agent loops (orchestrator,
// subagent).
type Flags struct {
	MaxExtraLoad float64
}

// Register adds --hedge-max-extra-load to fs, default 0 (off).
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.Float64Var(&f.MaxExtraLoad, "hedge-max-extra-load", 0,
		"hedge the agent loop's calls of read-only and idempotent tools (never model calls, never spawn_subagent): "+
			"a call that has not answered by the tool's (1 - this) latency quantile gets one backup, from the retry budget; "+
			"at most 0.5; 0.05 hedges at the p95; 0: off (docs/cluster.md#hedged-calls)")
}

// Validate reports a flag value out of its bounds.
func (f *Flags) Validate() error { return Config{MaxExtraLoad: f.MaxExtraLoad}.Validate() }

// Policy returns the flags' Policy, its metrics on reg; nil when hedging is off.
func (f *Flags) Policy(reg prometheus.Registerer) (*Policy, error) {
	if f.MaxExtraLoad == 0 {
		return nil, nil //nolint:nilnil // a nil Policy is hedging off, and usable
	}
	return New(Config{MaxExtraLoad: f.MaxExtraLoad, Metrics: NewMetrics(reg)})
}
