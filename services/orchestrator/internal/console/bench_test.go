package console

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// BenchmarkRunListPage measures the operator's filtered run list (a rare model within an
// hour, every tenant) as the console serves it, on PostgreSQL with 10,000 runs
// (storetest.SeedBenchRuns): the whole request on the server (session check, key lookup,
// sign-out check, the store query, the template) against the bare store query of the
// same filter in the same run, the floor.
func BenchmarkRunListPage(b *testing.B) {
	ctx := context.Background()
	clock := storetest.NewClock()
	st, err := store.Open(ctx, storetest.PostgresDSN(b), store.WithClock(clock.Now))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	if err := storetest.SeedBenchRuns(ctx, st, clock); err != nil {
		b.Fatal(err)
	}
	k, err := apikey.New(md.DefaultTenant)
	if err != nil {
		b.Fatal(err)
	}
	k.Record.Scopes = []string{store.ScopeAdmin}
	if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
		b.Fatal(err)
	}
	cc, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = cc.Close() }()
	h, err := New(Config{Orchestrator: orchestratorv1.NewOrchestratorServiceClient(cc), Admin: adminv1.NewAdminServiceClient(cc),
		Store: st, Keys: &apikey.Authenticator{Keys: st}, Secret: []byte(strings.Repeat("b", 32))})
	if err != nil {
		b.Fatal(err)
	}
	cookie, err := h.seal.seal(session{ID: "bench", Key: k.Secret, Exp: time.Now().Add(time.Hour)})
	if err != nil {
		b.Fatal(err)
	}
	q := storetest.BenchRareQuery()
	target := "/runs?" + url.Values{"model": {q.Model}, "from": {q.CreatedAfter.Format(timeForm)}, "to": {q.CreatedBefore.Format(timeForm)}}.Encode()

	report := func(b *testing.B, lat []time.Duration) {
		slices.Sort(lat)
		at := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) }
		b.ReportMetric(at(0.50), "p50-us")
		b.ReportMetric(at(0.99), "p99-us")
	}
	b.Run("store-floor", func(b *testing.B) {
		var lat []time.Duration
		for b.Loop() {
			t := time.Now()
			runs, _, err := st.ListRuns(ctx, q)
			lat = append(lat, time.Since(t))
			if err != nil || len(runs) != 12 {
				b.Fatalf("%d runs, %v", len(runs), err)
			}
		}
		report(b, lat)
	})
	b.Run("page", func(b *testing.B) {
		var lat []time.Duration
		for b.Loop() {
			req := httptest.NewRequest(http.MethodGet, target, nil)
			req.AddCookie(&http.Cookie{Name: sessionCookie, Value: cookie})
			w := httptest.NewRecorder()
			t := time.Now()
			h.ServeHTTP(w, req)
			lat = append(lat, time.Since(t))
			if w.Code != http.StatusOK || strings.Count(w.Body.String(), `<tr class="st-`) != 12 {
				b.Fatalf("GET %s: %d, %d rows", target, w.Code, strings.Count(w.Body.String(), `<tr class="st-`))
			}
		}
		report(b, lat)
	})
}
