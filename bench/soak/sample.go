package soak

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/bench"
)

// Process is one service process the load samples through its admin address.
type Process struct {
	Name  string `json:"name"`  // for example "modelproxy-a"
	Admin string `json:"admin"` // host:port of its /metrics (and /debug/pprof/ with --pprof)
}

// Sample is one process's figures at one instant; a process that did not answer (killed,
// restarting) has Up false and zeros.
type Sample struct {
	At         time.Time `json:"at"`
	Process    string    `json:"process"`
	Up         bool      `json:"up"`
	Goroutines float64   `json:"goroutines"`
	HeapInuse  float64   `json:"heap_inuse_bytes"`
	RSS        float64   `json:"rss_bytes"`
	CPUSeconds float64   `json:"cpu_seconds"`
	// Collected says a forced collection (/debug/pprof/heap?gc=1, served with --pprof)
	// came just before: HeapInuse is then the live heap.
	Collected bool `json:"collected,omitempty"`
}

type sampler struct {
	procs  []Process
	every  time.Duration
	client *http.Client
	mu     sync.Mutex
	out    []Sample
}

func newSampler(procs []Process, every time.Duration) *sampler {
	return &sampler{procs: procs, every: every, client: &http.Client{Timeout: 2 * time.Second}}
}

// run samples every period until ctx is done.
func (s *sampler) run(ctx context.Context) {
	t := time.NewTicker(s.every)
	defer t.Stop()
	for {
		s.mu.Lock()
		s.out = append(s.out, s.all(ctx, false)...)
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *sampler) samples() []Sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Sample(nil), s.out...)
}

// settled samples every process after a forced collection where it serves profiles
// (--pprof).
func (s *sampler) settled(ctx context.Context) []Sample { return s.all(ctx, true) }

func (s *sampler) all(ctx context.Context, gc bool) []Sample {
	out := make([]Sample, len(s.procs))
	var wg sync.WaitGroup
	for i, p := range s.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = s.one(ctx, p, gc)
		}()
	}
	wg.Wait()
	return out
}

func (s *sampler) one(ctx context.Context, p Process, gc bool) Sample {
	smp := Sample{At: time.Now(), Process: p.Name}
	if gc {
		_, err := s.get(ctx, "http://"+p.Admin+"/debug/pprof/heap?gc=1")
		smp.Collected = err == nil
	}
	body, err := s.get(ctx, "http://"+p.Admin+"/metrics")
	if err != nil {
		return smp
	}
	smp.Up = true
	smp.Goroutines, _ = bench.PromValue(body, "go_goroutines")
	smp.HeapInuse, _ = bench.PromValue(body, "go_memstats_heap_inuse_bytes")
	smp.RSS, _ = bench.PromValue(body, "process_resident_memory_bytes")
	smp.CPUSeconds, _ = bench.PromValue(body, "process_cpu_seconds_total")
	return smp
}

func (s *sampler) get(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return "", err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}

// profile takes every process's CPU profile over cfg.ProfileFor, from the middle of the
// load (or its start, when the load is shorter), and its allocation profile at the end
// of it, into cfg.ProfileDir.
func (s *sampler) profile(ctx context.Context, cfg Config, begin time.Time) error {
	d := cfg.ProfileFor
	if d <= 0 {
		d = DefaultProfileFor
	}
	if wait := time.Until(begin.Add(cfg.Duration/2 - d/2)); wait > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
	if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil { //nolint:gosec // profiles for people to read
		return err
	}
	long := &http.Client{Timeout: d + 30*time.Second}
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	for _, p := range s.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, f := range []struct{ path, file string }{
				{fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(d.Seconds())), p.Name + ".cpu.pprof"},
				{"/debug/pprof/allocs", p.Name + ".allocs.pprof"},
			} {
				if err := fetch(ctx, long, "http://"+p.Admin+f.path, filepath.Join(cfg.ProfileDir, f.file)); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%s: %w", p.Name, err))
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fetch writes the body of GET url to path.
func fetch(ctx context.Context, c *http.Client, url, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s (is the process started with --pprof?)", url, resp.Status)
	}
	f, err := os.Create(path) //nolint:gosec // a file in the directory the caller named
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// dumpLeft writes into dir the goroutines of every process whose count after the load
// is above its baseline by more than slack.
func (s *sampler) dumpLeft(ctx context.Context, dir string, baseline, after []Sample, slack int) error {
	before := map[string]Sample{}
	for _, b := range baseline {
		before[b.Process] = b
	}
	var errs []error
	for i, a := range after {
		if b := before[a.Process]; !a.Up || a.Goroutines <= b.Goroutines+float64(slack) {
			continue
		}
		if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // dumps for people to read
			return err
		}
		p := s.procs[i]
		if err := fetch(ctx, s.client, "http://"+p.Admin+"/debug/pprof/goroutine?debug=1", filepath.Join(dir, p.Name+".goroutines.txt")); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p.Name, err))
		}
	}
	return errors.Join(errs...)
}
