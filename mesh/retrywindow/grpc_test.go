package retrywindow_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sort"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/retrywindow"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

const replicaHeader = "x-test-replica"

// failing is a dependency that always fails UNAVAILABLE and records, by caller
// replica, when it received a retry (curfew-attempt > 1).
type failing struct {
	meshv1.UnimplementedNodeReportServiceServer
	mu      sync.Mutex
	first   int
	retries map[string][]time.Time
}

func (f *failing) ListNodes(ctx context.Context, _ *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	now := time.Now()
	in, _ := metadata.FromIncomingContext(ctx)
	replica := first(in.Get(replicaHeader))
	f.mu.Lock()
	if a := first(in.Get(md.Attempt)); a != "" && a != "1" {
		f.retries[replica] = append(f.retries[replica], now)
	} else {
		f.first++
	}
	f.mu.Unlock()
	return nil, status.Error(codes.Unavailable, "always down")
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// span is a run of one replica's retries with no gap longer than the split.
type span struct {
	replica     string
	first, last time.Time
}

// spans cuts each replica's retries into runs: a gap longer than split starts a new
// one. A run covers every retry in it, so two replicas retrying at the same moment show
// as overlapping runs, whatever the split.
func spans(retries map[string][]time.Time, split time.Duration) []span {
	var out []span
	for r, ts := range retries {
		sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
		cur := span{replica: r, first: ts[0], last: ts[0]}
		for _, t := range ts[1:] {
			if t.Sub(cur.last) > split {
				out = append(out, cur)
				cur = span{replica: r, first: t}
			}
			cur.last = t
		}
		out = append(out, cur)
	}
	return out
}

// peak is the most replicas with overlapping runs at any moment.
func peak(ss []span) int {
	type ev struct {
		at time.Time
		d  int
	}
	var evs []ev
	for _, s := range ss {
		evs = append(evs, ev{s.first, 1}, ev{s.last, -1})
	}
	sort.Slice(evs, func(i, j int) bool {
		if evs[i].at.Equal(evs[j].at) {
			return evs[i].d > evs[j].d
		}
		return evs[i].at.Before(evs[j].at)
	})
	n, p := 0, 0
	for _, e := range evs {
		n += e.d
		p = max(p, n)
	}
	return p
}

// TestReplicasRetryInTurns: three replicas (each its own Holder, connection and, on
// PostgreSQL, store handle) call a dependency that always fails, through the mesh
// client chain with its retries. The dependency sees retries from at most one replica
// at any moment, from more than one replica over the test (the window moves); the
// replicas without a window wait for it (retry.WindowRefusal) rather than retry, and
// every call still makes at most MaxAttempts attempts and fails marked exhausted.
func TestReplicasRetryInTurns(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	dep := &failing{retries: map[string][]time.Time{}}
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	meshv1.RegisterNodeReportServiceServer(srv, dep)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	length := 600 * time.Millisecond
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	type replica struct {
		name   string
		client meshv1.NodeReportServiceClient
	}
	var reps []replica
	for i := range 3 {
		st, err := store.Open(t.Context(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		h, err := retrywindow.New(retrywindow.Config{Store: st, Name: fmt.Sprint("r", i),
			Window: retry.WindowConfig{Replicas: 1, Length: length}, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = h.Close(context.Background()) })
		// A budget that never runs out: the window alone limits the retries here.
		rc := retry.Config{Target: "nodes", Window: h, Logger: quiet, Budget: retry.BudgetConfig{Disabled: true}}
		cc, err := grpc.NewClient(lis.Addr().String(), append(mesh.DialOptions(mesh.ClientConfig{Retry: rc}),
			grpc.WithTransportCredentials(insecure.NewCredentials()))...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cc.Close() })
		reps = append(reps, replica{name: fmt.Sprint("r", i), client: meshv1.NewNodeReportServiceClient(cc)})
	}
	var mu sync.Mutex
	unmarked := 0
	var wg sync.WaitGroup
	end := time.Now().Add(6 * length)
	for _, r := range reps {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(t.Context(), replicaHeader, r.name), 5*time.Second)
					_, err := r.client.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "run-1"})
					cancel()
					if !retry.IsExhausted(err) {
						mu.Lock()
						unmarked++
						mu.Unlock()
					}
					time.Sleep(2 * time.Millisecond)
				}
			}()
		}
	}
	wg.Wait()
	dep.mu.Lock()
	defer dep.mu.Unlock()
	ss := spans(dep.retries, length/4)
	total := 0
	for _, ts := range dep.retries {
		total += len(ts)
	}
	p := peak(ss)
	t.Logf("%d first attempts, %d retries from %d replicas in %d runs over %v; peak %d replicas retrying at once; %d calls not marked exhausted",
		dep.first, total, len(dep.retries), len(ss), 6*length, p, unmarked)
	if p > 1 {
		sort.Slice(ss, func(i, j int) bool { return ss[i].first.Before(ss[j].first) })
		t.Fatalf("%d replicas retried at once: %+v", p, ss)
	}
	if len(dep.retries) < 2 {
		t.Fatalf("only %d replica ever retried: the window did not move", len(dep.retries))
	}
	if unmarked > 0 {
		t.Fatalf("%d calls failed without the RETRIES_EXHAUSTED mark", unmarked)
	}
	if most := (retry.DefaultMaxAttempts - 1) * dep.first; total > most {
		t.Fatalf("%d first attempts, %d retries: more than %d retries per call", dep.first, total, retry.DefaultMaxAttempts-1)
	}
}
