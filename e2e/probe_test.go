package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// probeProviders is a providers file with one provider whose breaker opens after two
// failures, for 0.8–1.2 s.
const probeProviders = `{"providers": [{"name": "flaky", "base_url": "{flaky}", "models": ["m"]}],
  "models": {"agent": {"chain": ["flaky/m"]}},
  "breaker": {"failures": 2, "open_timeout": "1s", "jitter": 0.2}}`

// Issue 24's acceptance for item 4, on real processes: three modelproxy replicas on one
// PostgreSQL store, each called without pause, against a provider that answers every
// request 503 (UNAVAILABLE). Once their provider breakers are open, the provider receives
// one probe per open period, not one per replica: consecutive requests are at least the
// shortest open period apart, whichever replica sends them. Then the provider heals and
// one probe closes every replica's breaker. (With CURFEW_BREAKER_COORDINATION=off in the
// environment this test fails: 14 probes in 5 s, some 65 ms apart.)
func TestBreakerOneProbeAcrossReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	var (
		mu      sync.Mutex
		hits    []time.Time
		healthy bool
	)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		hits = append(hits, time.Now())
		ok := healthy
		mu.Unlock()
		if !ok {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error": {"message": "down", "type": "server_error"}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		const head = `data: {"id":"chatcmpl-probe","object":"chat.completion.chunk","created":0,"model":"m","choices":`
		_, _ = io.WriteString(w, head+`[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}`+"\n\n"+
			head+`[{"index":0,"delta":{"content":"ok"},"finish_reason":null}],"usage":null}`+"\n\n"+
			head+`[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}`+"\n\n"+
			head+`[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`+"\n\n"+
			"data: [DONE]\n\n")
	}))
	t.Cleanup(upstream.Close)
	since := func(from time.Time) []time.Time {
		mu.Lock()
		defer mu.Unlock()
		var out []time.Time
		for _, h := range hits {
			if !h.Before(from) {
				out = append(out, h)
			}
		}
		return out
	}

	dir, err := os.MkdirTemp("", "curfew-probe-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "providers.json")
	if err := os.WriteFile(cfg, []byte(strings.ReplaceAll(probeProviders, "{flaky}", upstream.URL+"/v1")), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(ctx, dir, storetest.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if !t.Failed() {
			_ = os.RemoveAll(dir)
		} else {
			t.Logf("process logs are in %s", dir)
		}
	})
	const n = 3
	var procs []*meshproc.Proc
	var clients []modelproxyv1.ModelProxyServiceClient
	for i := range n {
		p, err := c.Add(ctx, "modelproxy", fmt.Sprintf("modelproxy-%c", 'a'+i), "--store", c.Store, "--providers-config", cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
		cc, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		procs, clients = append(procs, p), append(clients, modelproxyv1.NewModelProxyServiceClient(cc))
	}

	// Every replica is called every 20 ms until the end.
	dctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	for i, mp := range clients {
		wg.Go(func() {
			for k := 0; dctx.Err() == nil; k++ {
				cctx, ccancel := context.WithTimeout(metadata.AppendToOutgoingContext(dctx, "curfew-run-id", "e2e-probe",
					"curfew-node-id", fmt.Sprintf("r%d/n%d", i, k)), 5*time.Second)
				if st, err := mp.Generate(cctx, &modelproxyv1.GenerateRequest{Model: "agent",
					Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: "hello"}}}); err == nil {
					for {
						if _, err := st.Recv(); err != nil {
							break
						}
					}
				}
				ccancel()
				time.Sleep(20 * time.Millisecond)
			}
		})
	}

	breakers := func(state string) bool {
		for _, p := range procs {
			if probeMetric(t, p, `curfew_circuit_breaker_state{state="`+state+`",target="flaky"}`) != 1 {
				return false
			}
		}
		return true
	}
	waitUntil := func(what string, limit time.Duration, ok func() bool) {
		t.Helper()
		end := time.Now().Add(limit)
		for !ok() {
			if time.Now().After(end) {
				t.Fatalf("%s: not within %v", what, limit)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitUntil("every replica's breaker open", 20*time.Second, func() bool { return !breakersAny(t, procs, "closed") })
	from := time.Now()
	const watch = 5 * time.Second
	time.Sleep(watch)
	got := since(from)
	const shortestOpen = 800 * time.Millisecond
	// With --breaker-coordination=off the same run sees about n per period (14 in 5 s).
	t.Logf("%d replicas, breakers open: the provider received %d requests in %v", n, len(got), watch)
	if max := int(watch/shortestOpen) + 1; len(got) < 2 || len(got) > max {
		t.Errorf("%d probes in %v, want 2 to %d: one per open period", len(got), watch, max)
	}
	for i := 1; i < len(got); i++ {
		if gap := got[i].Sub(got[i-1]); gap < shortestOpen-50*time.Millisecond {
			t.Errorf("probes %d and %d %v apart, want at least the shortest open period %v", i-1, i, gap.Round(time.Millisecond), shortestOpen)
		}
	}

	mu.Lock()
	healthy = true
	mu.Unlock()
	healed := time.Now()
	waitUntil("every replica's breaker closed after the provider healed", 10*time.Second, func() bool { return breakers("closed") })
	t.Logf("all closed %v after the provider healed", time.Since(healed).Round(time.Millisecond))
	var succeeded float64
	for _, p := range procs {
		succeeded += probeMetric(t, p, `curfew_circuit_breaker_probes_total{outcome="success",target="flaky"}`)
	}
	if succeeded != 1 {
		t.Errorf("successful probes summed over the replicas: %v, want 1", succeeded)
	}
}

// breakersAny reports whether any replica's provider breaker is in state.
func breakersAny(t *testing.T, procs []*meshproc.Proc, state string) bool {
	for _, p := range procs {
		if probeMetric(t, p, `curfew_circuit_breaker_state{state="`+state+`",target="flaky"}`) == 1 {
			return true
		}
	}
	return false
}

// probeMetric returns the value of one series on p's /metrics, -1 if it is not there.
func probeMetric(t *testing.T, p *meshproc.Proc, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + p.AdminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err == nil {
				return f
			}
		}
	}
	return -1
}
