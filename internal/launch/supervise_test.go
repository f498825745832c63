package launch

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// startFakeMesh starts the four services as fake children ("serve") and waits until they
// serve; t.Cleanup stops them.
func startFakeMesh(t *testing.T) *Mesh {
	t.Helper()
	t.Setenv(childEnv, "serve")
	eps, err := Allocate(0)
	if err != nil {
		t.Fatal(err)
	}
	bins := map[string]string{}
	for _, s := range Services {
		bins[s] = os.Args[0]
	}
	m, err := Start(Config{Bins: bins, Endpoints: eps, LogDir: t.TempDir(), StopGrace: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Stop)
	if err := m.WaitServing(t.Context(), 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return m
}

// recorder collects Supervise's events.
type recorder struct {
	mu     sync.Mutex
	events []Event
	seen   chan Event
}

func newRecorder() *recorder { return &recorder{seen: make(chan Event, 100)} }

func (r *recorder) report(e Event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
	r.seen <- e
}

// await waits for an event of kind for service.
func (r *recorder) await(t *testing.T, kind EventKind, service string) Event {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case e := <-r.seen:
			if e.Kind == kind && e.Service == service {
				return e
			}
		case <-timeout:
			t.Fatalf("no %s event of %s; events: %v", kind, service, r.events)
		}
	}
}

// A service killed with SIGKILL is restarted on its address after the backoff, serves
// again under a new pid, and the events say so in order; the others are left alone.
func TestSuperviseRestartsACrashedService(t *testing.T) {
	m := startFakeMesh(t)
	ctx, cancel := context.WithCancel(context.Background())
	rec := newRecorder()
	result := make(chan error, 1)
	go func() { result <- m.Supervise(ctx, RestartPolicy{Backoff: 50 * time.Millisecond}, rec.report) }()

	model := m.Processes()[0]
	if model.Name != "modelproxy" {
		t.Fatalf("first process %s, want modelproxy", model.Name)
	}
	for round := 1; round <= 2; round++ {
		old := model.PID()
		if err := model.Kill(); err != nil {
			t.Fatal(err)
		}
		ex := rec.await(t, Exited, "modelproxy")
		if ex.Restarts != round || ex.Err == nil || !strings.Contains(ex.Err.Error(), "killed") {
			t.Fatalf("exit event %+v: want restart %d after a kill", ex, round)
		}
		if want := 50 * time.Millisecond << (round - 1); ex.Backoff != want {
			t.Fatalf("backoff %v, want %v (doubling)", ex.Backoff, want)
		}
		re := rec.await(t, Restarted, "modelproxy")
		if re.PID == 0 || re.PID == old || re.PID != model.PID() {
			t.Fatalf("restart event %+v: want the new pid (old %d, now %d)", re, old, model.PID())
		}
		if err := WaitServing(t.Context(), 5*time.Second, model); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if err := <-result; err != nil {
		t.Fatalf("Supervise: %v, want nil once its context ended", err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, e := range rec.events {
		if e.Service != "modelproxy" {
			t.Errorf("event of %s, which never exited: %v", e.Service, e)
		}
	}
}

// A service that keeps exiting at start-up is restarted MaxRestarts times, then
// Supervise gives up and returns an error naming it.
func TestSuperviseGivesUpOnACrashLoop(t *testing.T) {
	m := startFakeMesh(t)
	rec := newRecorder()
	t.Setenv(childEnv, "exit") // every restart exits at once with status 3
	tools := m.Processes()[2]
	if tools.Name != "toolrunner" {
		t.Fatalf("third process %s, want toolrunner", tools.Name)
	}
	if err := tools.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := m.Supervise(ctx, RestartPolicy{Backoff: 10 * time.Millisecond, MaxRestarts: 3}, rec.report)
	if err == nil || !strings.Contains(err.Error(), "toolrunner crash-looped: 3 restarts") {
		t.Fatalf("Supervise: %v, want toolrunner's crash loop", err)
	}
	var kinds []string
	rec.mu.Lock()
	for _, e := range rec.events {
		kinds = append(kinds, string(e.Kind))
	}
	last := rec.events[len(rec.events)-1]
	rec.mu.Unlock()
	want := "exited restart_failed restart_failed restart_failed gave_up"
	if got := strings.Join(kinds, " "); got != want {
		t.Fatalf("events %q, want %q", got, want)
	}
	if last.Restarts != 3 || last.Err == nil || !strings.Contains(last.Err.Error(), "exited during start-up") {
		t.Fatalf("last event %+v", last)
	}
	if ctx.Err() != nil {
		t.Fatal("Supervise returned only at its deadline")
	}
}
