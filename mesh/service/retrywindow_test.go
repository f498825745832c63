package service_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// TestCoordinateRetries: on a shared store, of two replicas calling a failing target
// the first to retry holds the target's window and retries; the other, whose call has
// less time than the window has left (so it cannot wait for it to move), fails its call
// after one attempt, marked exhausted, and says so in its metrics. On a private store
// CoordinateRetries changes nothing.
func TestCoordinateRetries(t *testing.T) {
	f := &failing{code: codes.Unavailable}
	server := start(t, validOptions(), func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, f) })
	dsn := storetest.PostgresDSN(t)
	replica := func(st service.SharedSlots) (*running, *grpc.ClientConn) {
		fs, o := newFlags()
		if err := service.Parse(fs, []string{"--addr=127.0.0.1:0", "--admin-addr=127.0.0.1:0", "--insecure", "--breaker-off"}, env(nil)); err != nil {
			t.Fatal(err)
		}
		r := start(t, *o, nil)
		if err := r.rt.CoordinateRetries(st); err != nil {
			t.Fatal(err)
		}
		cc, err := r.rt.Dial("toolrunner", server.rt.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cc.Close() })
		return r, cc
	}
	shared := func() store.Store {
		st, err := store.Open(context.Background(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		return st
	}

	_, private := replica(storetest.OpenMemory(t))
	if err := execute(t, private); !retry.IsExhausted(err) {
		t.Fatalf("private: %v", err)
	}
	if n := f.calls.Swap(0); n != retry.DefaultMaxAttempts {
		t.Fatalf("private store: server saw %d attempts, want %d", n, retry.DefaultMaxAttempts)
	}

	a, ca := replica(shared())
	b, cb := replica(shared())
	if err := execute(t, ca); !retry.IsExhausted(err) {
		t.Fatalf("a: %v", err)
	}
	if n := f.calls.Swap(0); n != retry.DefaultMaxAttempts {
		t.Fatalf("a, first to retry: server saw %d attempts, want %d", n, retry.DefaultMaxAttempts)
	}
	if err := executeWithin(t, cb, 3*time.Second); !retry.IsExhausted(err) || status.Code(err) != codes.Unavailable {
		t.Fatalf("b: %v", err)
	}
	if n := f.calls.Swap(0); n != 1 {
		t.Fatalf("b, without a window: server saw %d attempts, want 1", n)
	}
	_, body := get(t, a.admin+"/metrics")
	if !strings.Contains(body, `curfew_retry_window_leases_held{target="toolrunner"} 1`) {
		t.Errorf("a's /metrics lacks its window:\n%s", grep(body, "curfew_retry_window"))
	}
	_, body = get(t, b.admin+"/metrics")
	for _, line := range []string{
		`curfew_retry_window_leases_held{target="toolrunner"} 0`,
		`curfew_retry_window_refused_total{reason="busy",target="toolrunner"} 1`,
		`curfew_retry_window_refused_total{reason="store_down",target="toolrunner"} 0`,
	} {
		if !strings.Contains(body, line) {
			t.Errorf("b's /metrics lacks %s:\n%s", line, grep(body, "curfew_retry_window"))
		}
	}
}

func grep(body, prefix string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
