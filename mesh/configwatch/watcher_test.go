package configwatch_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/curfew-mesh/curfew/mesh/configwatch"
)

// limits is the test's configuration: a pool limit that must be at least 1.
type limits struct {
	Max int `json:"max"`
}

func loadLimits(b []byte) (limits, error) {
	var l limits
	if err := json.Unmarshal(b, &l); err != nil {
		return limits{}, err
	}
	if l.Max < 1 {
		return limits{}, fmt.Errorf("max %d: must be at least 1", l.Max)
	}
	return l, nil
}

// applied records what Apply was given.
type applied struct {
	mu  sync.Mutex
	got []int
}

func (a *applied) apply(l limits) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.got = append(a.got, l.Max)
	return nil
}

func (a *applied) last() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.got) == 0 {
		return 0
	}
	return a.got[len(a.got)-1]
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// eventually polls cond for up to 10 s: generous on a loaded machine.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

type rig struct {
	w   *configwatch.Watcher[limits]
	a   *applied
	reg *prometheus.Registry
	m   *configwatch.Metrics
}

func newRig(t *testing.T, path string, interval time.Duration) *rig {
	t.Helper()
	r := &rig{a: &applied{}, reg: prometheus.NewRegistry()}
	r.m = configwatch.NewMetrics("test", r.reg)
	w, err := configwatch.New(configwatch.Config[limits]{Name: "limits", Path: path, Load: loadLimits, Apply: r.a.apply,
		Interval: interval}, r.m, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.w = w
	ctx, cancel := context.WithCancel(context.Background())
	w.Start(ctx)
	t.Cleanup(func() { cancel(); w.Close() })
	return r
}

func (r *rig) failures() float64 {
	return testutil.ToFloat64(r.m.Failures("limits"))
}

func TestRewriteReloads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "limits.json")
	write(t, path, `{"max": 2}`)
	r := newRig(t, path, 10*time.Millisecond)
	if got := r.w.Current().Max; got != 2 {
		t.Fatalf("start: max %d, want 2", got)
	}
	v1 := r.w.Status().Version
	if len(v1) != 12 {
		t.Fatalf("version %q, want 12 hex digits", v1)
	}
	// The series exist at zero from the start.
	if n := testutil.CollectAndCount(r.reg, "curfew_config_reload_failures_total"); n != 1 {
		t.Fatalf("%d failure series at start, want 1", n)
	}
	write(t, path, `{"max": 5}`)
	eventually(t, "the rewrite to be applied", func() bool { return r.a.last() == 5 })
	st := r.w.Status()
	if st.Version == v1 || st.LastError != "" || r.w.Current().Max != 5 {
		t.Fatalf("after rewrite: %+v, current %+v", st, r.w.Current())
	}
	if f := r.failures(); f != 0 {
		t.Fatalf("failures %v, want 0", f)
	}
}

func TestBadFileKeepsTheRunningConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "limits.json")
	write(t, path, `{"max": 2}`)
	r := newRig(t, path, 10*time.Millisecond)
	v1 := r.w.Status().Version

	write(t, path, `{"max": 0}`)
	eventually(t, "the failure to be counted", func() bool { return r.failures() == 1 })
	st := r.w.Status()
	if r.w.Current().Max != 2 || st.Version != v1 || !strings.Contains(st.LastError, "must be at least 1") || st.LastErrorAt.IsZero() {
		t.Fatalf("after a bad file: %+v, current %+v", st, r.w.Current())
	}
	if r.a.last() != 0 {
		t.Fatalf("Apply was called with %d", r.a.last())
	}
	// The same bad content is reported once, not on every read.
	time.Sleep(100 * time.Millisecond)
	if f := r.failures(); f != 1 {
		t.Fatalf("failures %v after the same bad content stayed, want 1", f)
	}
	// Not JSON at all, then removed: each a failure of its own, the config kept.
	write(t, path, `{"max": `)
	eventually(t, "the second failure", func() bool { return r.failures() == 2 })
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the third failure", func() bool { return r.failures() == 3 })
	if r.w.Current().Max != 2 {
		t.Fatalf("current %+v, want the first config", r.w.Current())
	}
	// A good file again clears the error.
	write(t, path, `{"max": 3}`)
	eventually(t, "the good file", func() bool { return r.a.last() == 3 })
	if st := r.w.Status(); st.LastError != "" || !st.LastErrorAt.IsZero() {
		t.Fatalf("after a good file: %+v", st)
	}
}

// A Kubernetes ConfigMap volume: the file is a symlink to ..data/limits.json, and an
// update writes a new directory and swaps ..data to it atomically (a rename).
func TestConfigMapSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	mkVersion := func(name, content string) {
		if err := os.Mkdir(filepath.Join(dir, name), 0o700); err != nil {
			t.Fatal(err)
		}
		write(t, filepath.Join(dir, name, "limits.json"), content)
	}
	swap := func(target string) {
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(target, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	mkVersion("..2026_12_03_09_00_00.1", `{"max": 2}`)
	swap("..2026_12_03_09_00_00.1")
	path := filepath.Join(dir, "limits.json")
	if err := os.Symlink(filepath.Join("..data", "limits.json"), path); err != nil {
		t.Fatal(err)
	}
	r := newRig(t, path, 10*time.Millisecond)
	if r.w.Current().Max != 2 {
		t.Fatalf("start: %+v", r.w.Current())
	}
	mkVersion("..2026_12_03_09_05_00.2", `{"max": 7}`)
	swap("..2026_12_03_09_05_00.2")
	if err := os.RemoveAll(filepath.Join(dir, "..2026_12_03_09_00_00.1")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the swapped ConfigMap", func() bool { return r.a.last() == 7 })
}

func TestSIGHUPReloads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "limits.json")
	write(t, path, `{"max": 2}`)
	// An hour between reads: only SIGHUP can make it reload within the test.
	r := newRig(t, path, time.Hour)
	write(t, path, `{"max": 4}`)
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the reload on SIGHUP", func() bool { return r.a.last() == 4 })
	// SIGHUP reloads unchanged content too (Apply may have failed for a reason outside the file).
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the second reload", func() bool {
		r.a.mu.Lock()
		defer r.a.mu.Unlock()
		return len(r.a.got) == 2
	})
}

func TestApplyErrorKeepsTheRunningConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "limits.json")
	write(t, path, `{"max": 2}`)
	m := configwatch.NewMetrics("test", nil)
	var statuses []configwatch.Status
	w, err := configwatch.New(configwatch.Config[limits]{Name: "limits", Path: path, Load: loadLimits,
		Apply:    func(limits) error { return errors.New("pool paid is draining") },
		OnReload: func(s configwatch.Status) { statuses = append(statuses, s) },
	}, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	write(t, path, `{"max": 9}`)
	if err := w.Reload(); err == nil || !strings.Contains(err.Error(), "draining") {
		t.Fatalf("Reload: %v, want Apply's error", err)
	}
	if w.Current().Max != 2 || testutil.ToFloat64(m.Failures("limits")) != 1 {
		t.Fatalf("current %+v, failures %v", w.Current(), testutil.ToFloat64(m.Failures("limits")))
	}
	if len(statuses) != 1 || statuses[0].LastError == "" {
		t.Fatalf("OnReload saw %+v", statuses)
	}
	w.Close() // never started: a no-op
}

func TestNewRefusesABadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "limits.json")
	write(t, path, `{"max": 0}`)
	if _, err := configwatch.New(configwatch.Config[limits]{Name: "limits", Path: path, Load: loadLimits}, nil, nil); err == nil ||
		!strings.Contains(err.Error(), path) {
		t.Fatalf("New: %v, want an error naming the file", err)
	}
	if _, err := configwatch.New(configwatch.Config[limits]{Name: "limits", Path: filepath.Join(t.TempDir(), "none"), Load: loadLimits}, nil, nil); err == nil {
		t.Fatal("New of a missing file succeeded")
	}
}
