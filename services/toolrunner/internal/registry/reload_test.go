package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// sessions opens a new fake per open of a source, and remembers them by source name.
type sessions struct {
	mu     sync.Mutex
	opened map[string][]*fake
	call   func(ctx context.Context, c source.Call) (source.Result, error)
}

func (s *sessions) open(_ context.Context, sc SourceConfig, _ Hooks) (source.Source, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := &fake{tools: []source.Tool{{Name: "x"}, {Name: "slow"}}, call: s.call}
	s.opened[sc.Name] = append(s.opened[sc.Name], f)
	return f, nil
}

func (s *sessions) of(name string) []*fake {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.opened[name])
}

func (f *fake) isClosed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.closed
}

// A reload keeps the session of an unchanged source, opens an added one, and closes a
// removed or changed one only once its calls in flight have ended; a changed source comes
// back with a new session.
func TestUpdateSessions(t *testing.T) {
	release, started := make(chan struct{}), make(chan struct{}, 1)
	ss := &sessions{opened: map[string][]*fake{}, call: func(ctx context.Context, c source.Call) (source.Result, error) {
		if c.Tool == "slow" {
			started <- struct{}{}
			<-release
		}
		return source.Result{Output: json.RawMessage(`1`)}, nil
	}}
	parse := func(file string) *Config {
		t.Helper()
		cfg, err := Parse([]byte(file), lookupEnv, lookPath)
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	r, err := New(parse(`{"sources": [`+grpcSource("keep", "")+`, `+grpcSource("change", "")+`, `+grpcSource("drop", "")+`]}`),
		Options{Openers: map[string]Opener{KindGRPC: ss.open}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			Breaker: breaker.Config{OpenTimeout: 20 * time.Millisecond, Jitter: -1},
			Relist:  retry.Policy{Base: 5 * time.Millisecond, Cap: 20 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	eventually(t, "the first lists", func() bool { return len(names(r, "")) == 6 })

	// A call in flight on the source the reload removes.
	p, err := r.Prepare("", "drop__slow", nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := p.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {})
		done <- err
	}()
	<-started
	// And one prepared before the reload but not yet run.
	late, err := r.Prepare("", "change__x", nil)
	if err != nil {
		t.Fatal(err)
	}

	next := parse(`{"sources": [` + grpcSource("keep", "") + `, ` + grpcSource("change", `, "concurrency": 3`) + `, ` + grpcSource("fresh", "") + `]}`)
	if err := r.Update(next); err != nil {
		t.Fatalf("Update: %v", err)
	}
	eventually(t, "the new list", func() bool {
		return slices.Equal(names(r, ""), []string{"change__slow", "change__x", "fresh__slow", "fresh__x", "keep__slow", "keep__x"})
	})
	if _, err := r.Prepare("", "drop__x", nil); status.Code(err) != codes.NotFound {
		t.Fatalf("Prepare of a removed source's tool: %v, want NOT_FOUND", err)
	}
	if _, err := late.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {}); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call prepared before the reload on a changed source: %v, want UNAVAILABLE", err)
	}
	if keep := ss.of("keep"); len(keep) != 1 || keep[0].isClosed() {
		t.Fatalf("the unchanged source was reopened or closed: %d sessions", len(keep))
	}
	eventually(t, "the changed source's new session", func() bool {
		ch := ss.of("change")
		return len(ch) == 2 && ch[0].isClosed() && !ch[1].isClosed()
	})
	drop := ss.of("drop")[0]
	time.Sleep(20 * time.Millisecond)
	if drop.isClosed() {
		t.Fatal("the removed source was closed under its call in flight")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("the call in flight on the removed source: %v", err)
	}
	eventually(t, "the removed source closed after its last call", drop.isClosed)
	// The changed source's new policy holds: concurrency 3.
	r.mu.RLock()
	c := cap(r.byName["change"].sem)
	r.mu.RUnlock()
	if c != 3 {
		t.Fatalf("the changed source's concurrency is %d, want 3", c)
	}

	// A kind without an opener changes nothing.
	bad := parse(`{"sources": [{"name": "m", "kind": "mcp_http", "url": "http://127.0.0.1:1/mcp"}]}`)
	if err := r.Update(bad); err == nil {
		t.Fatal("Update with a kind without an opener succeeded")
	}
	if n := len(names(r, "")); n != 6 {
		t.Fatalf("%d tools after a refused Update, want 6", n)
	}
}

// Lists landing at once from several sources, with a reload's rebuild among them, leave
// the table made from every source's newest list: no rebuild stores an older snapshot
// over a newer one.
func TestRebuildsKeepTheNewestLists(t *testing.T) {
	ss := &sessions{opened: map[string][]*fake{}}
	var srcs []string
	for _, n := range strings.Split("abcdefghijklmnop", "") {
		srcs = append(srcs, grpcSource(n, ""))
	}
	cfg, err := Parse([]byte(`{"sources": [`+strings.Join(srcs, ", ")+`]}`), lookupEnv, lookPath)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(cfg, Options{Openers: map[string]Opener{KindGRPC: ss.open}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	eventually(t, "the first lists", func() bool { return len(names(r, "")) == 32 })
	r.mu.RLock()
	sources := slices.Clone(r.sources)
	r.mu.RUnlock()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for round := range 1000 {
		var wg sync.WaitGroup
		for _, s := range sources {
			wg.Go(func() {
				r.setTools(s, []source.Tool{{Name: fmt.Sprintf("v%d", round)}}, log)
			})
		}
		wg.Go(r.rebuild)
		wg.Wait()
		want := make([]string, 0, len(sources))
		for _, s := range sources {
			want = append(want, fmt.Sprintf("%s__v%d", s.cfg.Name, round))
		}
		if got := names(r, ""); !slices.Equal(got, want) {
			t.Fatalf("round %d: the table lists %v, want %v", round, got, want)
		}
	}
}
