package mcp

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/internal/mcptest"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "curfew-mcp-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

var (
	buildOnce sync.Once
	buildErr  error
)

// testServer builds internal/mcptest/cmd/curfew-mcptest once and returns its path.
func testServer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(binDir, "curfew-mcptest")
	buildOnce.Do(func() {
		repo, err := meshproc.Repo()
		if err != nil {
			buildErr = err
			return
		}
		cmd := exec.Command("go", "build", "-o", bin, "./internal/mcptest/cmd/curfew-mcptest")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("building curfew-mcptest: %w\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return bin
}

// testOptions are fast restarts and a small message limit, with late messages counted.
func testOptions(t *testing.T, late *lateCounter) Options {
	return Options{
		MaxMessageBytes:   64 << 10,
		Late:              late.inc,
		MinRestartBackoff: 50 * time.Millisecond,
		MaxRestartBackoff: 500 * time.Millisecond,
		Logger:            testLogger(t),
	}
}

type lateCounter struct {
	mu sync.Mutex
	n  int
}

func (l *lateCounter) inc() { l.mu.Lock(); l.n++; l.mu.Unlock() }
func (l *lateCounter) get() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n
}

// openStdio starts curfew-mcptest over stdio, recording to the returned file.
func openStdio(t *testing.T, late *lateCounter) (*Source, string) {
	t.Helper()
	record := filepath.Join(t.TempDir(), "record.jsonl")
	s, err := OpenStdio(t.Context(), StdioConfig{Name: "mcptest", Command: testServer(t), Args: []string{"--record", record}}, testOptions(t, late))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, record
}

// startHTTPServer runs curfew-mcptest --http on addr until the test ends and waits
// until it listens.
func startHTTPServer(t *testing.T, addr, record string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(testServer(t), "--http", addr, "--record", record)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	listening := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := sync.Once{}
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "listening on") {
				once.Do(func() { close(listening) })
			}
		}
	}()
	select {
	case <-listening:
	case <-time.After(20 * time.Second):
		t.Fatal("curfew-mcptest --http did not start listening within 20s")
	}
	return cmd
}

// freeAddr returns a loopback address nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr
}

// openHTTP starts curfew-mcptest --http and opens a source on it.
func openHTTP(t *testing.T, late *lateCounter) (*Source, string) {
	t.Helper()
	record := filepath.Join(t.TempDir(), "record.jsonl")
	addr := freeAddr(t)
	startHTTPServer(t, addr, record)
	s, err := OpenHTTP(t.Context(), HTTPConfig{Name: "mcptest", URL: "http://" + addr + "/"}, testOptions(t, late))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s, record
}

// waitRecord polls the record file until a record matches, for at most d.
func waitRecord(t *testing.T, path string, d time.Duration, match func(mcptest.Record) bool) mcptest.Record {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		recs, err := mcptest.ReadRecords(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			if match(r) {
				return r
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no matching record in %s within %v; have %+v", path, d, recs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitUp waits until the source lists tools again, for at most d.
func waitUp(t *testing.T, s *Source, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		_, err := s.List(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("source not up within %v: %v", d, err)
		}
		select {
		case <-s.Changed():
		case <-time.After(100 * time.Millisecond):
		}
	}
}
