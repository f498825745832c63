package modelproxy

import (
	"fmt"
	"slices"
	"testing"
	"time"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

// BenchmarkFallbackTTFT measures the time to first token through modelproxy (gRPC on
// loopback, the OpenAI client, an openaitest server over HTTP) in two setups side by side:
// the primary healthy and answering, and the primary's breaker open so that the call
// falls back to the backup. Both upstreams answer alike; the difference is what an open
// breaker costs on the way to the fallback. Rounds alternate the two setups so they see
// the same machine noise; p50 and p90 of each are reported as custom metrics.
//
//	go test -run '^$' -bench BenchmarkFallbackTTFT -benchtime 200x ./internal/modelproxy/
func BenchmarkFallbackTTFT(b *testing.B) {
	// fencedprimary is a third provider whose breaker is opened before timing.
	pe := newProviderEnv(b, `{"providers": [
	    {"name": "primary", "base_url": "{primary}", "models": ["m"]},
	    {"name": "fencedprimary", "base_url": "{fencedprimary}", "models": ["m"]},
	    {"name": "backup", "base_url": "{backup}", "models": ["m"]}],
	  "models": {"healthy": {"chain": ["primary/m", "backup/m"]},
	             "fenced": {"chain": ["fencedprimary/m", "backup/m"]}},
	  "breaker": {"failures": 1, "open_timeout": "1h", "jitter": 0.01}}`, "primary", "fencedprimary", "backup")
	reply := openaitest.Reply{Content: openaitest.Tokens(2)}
	for _, u := range pe.up {
		u.Handle(func(openaitest.Request) openaitest.Reply { return reply })
	}
	pe.up["fencedprimary"].Handle(func(openaitest.Request) openaitest.Reply {
		return openaitest.Reply{Status: 503, Error: ptr(openaitest.ErrorFor(503))}
	})
	ttft := func(model string, i int) time.Duration {
		ctx := ident("bench", fmt.Sprintf("%s/m%d", model, i))
		start := time.Now()
		st, err := pe.model.Generate(ctx, &modelproxyv1.GenerateRequest{Model: model, Messages: userMsg("hi")})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		for {
			if _, err := st.Recv(); err != nil {
				break
			}
		}
		return d
	}
	ttft("fenced", -1) // one failure opens the fenced primary's breaker
	if s := pe.srv.Router.Breaker("fencedprimary").State(); s != breaker.StateOpen {
		b.Fatalf("fenced primary's breaker is %v", s)
	}
	for i := range 20 { // warm both paths
		ttft("healthy", -2-i)
		ttft("fenced", -100-i)
	}
	var healthy, fenced []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 0 {
			healthy = append(healthy, ttft("healthy", i))
			fenced = append(fenced, ttft("fenced", i))
		} else {
			fenced = append(fenced, ttft("fenced", i))
			healthy = append(healthy, ttft("healthy", i))
		}
	}
	b.StopTimer()
	q := func(xs []time.Duration, p float64) float64 {
		s := slices.Clone(xs)
		slices.Sort(s)
		return float64(s[int(p*float64(len(s)-1))].Microseconds())
	}
	b.ReportMetric(q(healthy, 0.5), "healthy-p50-µs")
	b.ReportMetric(q(fenced, 0.5), "fenced-p50-µs")
	b.ReportMetric(q(fenced, 0.5)-q(healthy, 0.5), "added-p50-µs")
	b.ReportMetric(q(healthy, 0.9), "healthy-p90-µs")
	b.ReportMetric(q(fenced, 0.9), "fenced-p90-µs")
	if got := pe.up["fencedprimary"].Count(); got != 1 {
		b.Fatalf("the fenced primary saw %d requests, want only the one that opened it", got)
	}
}
