package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// TestEverythingServer runs the MCP reference server (@modelcontextprotocol/server-everything,
// TypeScript SDK, pinned in scripts/mcp-everything) over stdio: a server curfew did not
// write, whose long-running tool ignores the cancel and keeps reporting progress.
func TestEverythingServer(t *testing.T) {
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	entry := filepath.Join(repo, ".tools", "mcp-everything", "node_modules", "@modelcontextprotocol", "server-everything", "dist", "index.js")
	if _, err := os.Stat(entry); err != nil {
		meshproc.Missing(t, "server-everything not installed (%v); scripts/node.sh mcp installs it", err)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		meshproc.Missing(t, "node not on PATH; scripts/node.sh installs it under CI")
	}
	late := &lateCounter{}
	s, err := OpenStdio(t.Context(), StdioConfig{Name: "everything", Command: node, Args: []string{entry, "stdio"}}, testOptions(t, late))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()

	tools, err := s.List(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(tools, func(t source.Tool) bool { return t.Name == "echo" })
	if i < 0 || !slices.ContainsFunc(tools, func(t source.Tool) bool { return t.Name == "trigger-long-running-operation" }) {
		t.Fatalf("tools %v: want echo and trigger-long-running-operation", tools)
	}
	if h := tools[i].Hints; h.ReadOnly == nil || !*h.ReadOnly || h.Destructive == nil || *h.Destructive {
		t.Fatalf("echo's hints %+v, want read-only and not destructive as the server annotates it", h)
	}

	res, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"message":"curfew"}`), Meta: testMeta()}, noProgress)
	if err != nil || res.IsError || !strings.Contains(string(res.Output), "Echo: curfew") {
		t.Fatalf("echo: %+v (%s), %v", res, res.Output, err)
	}

	// 30 steps of 100 ms; cancel after the third report.
	ctx, cancel := context.WithCancel(t.Context())
	var returned atomic.Bool
	var delivered, afterReturn atomic.Int32
	third := make(chan struct{})
	progress := func(p *meshv1.Progress) {
		if returned.Load() {
			afterReturn.Add(1)
		}
		if delivered.Add(1) == 3 {
			close(third)
		}
		if p.GetTotal() != 30 {
			t.Errorf("progress %v: want total 30", p)
		}
	}
	done := make(chan error, 1)
	go func() {
		_, err := s.Call(ctx, source.Call{Tool: "trigger-long-running-operation", Args: json.RawMessage(`{"duration":3,"steps":30}`), Meta: testMeta()}, progress)
		returned.Store(true)
		done <- err
	}()
	select {
	case <-third:
	case <-time.After(20 * time.Second):
		t.Fatal("no third progress report within 20s")
	}
	cancelled := time.Now()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Call: %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Call did not return within 5s of the cancel")
	}
	if took := time.Since(cancelled); took > time.Second {
		t.Fatalf("Call returned %v after the cancel, want promptly", took)
	}
	// The operation would have ended 3 s after it began; wait that out with margin.
	time.Sleep(3500 * time.Millisecond)
	if n := afterReturn.Load(); n != 0 {
		t.Fatalf("%d progress reports reached the callback after Call returned", n)
	}
	t.Logf("%d reports delivered, %d counted late", delivered.Load(), late.get())
	if late.get() == 0 {
		t.Fatal("the server's reports after the cancel were not counted late")
	}

	res, err = s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"message":"again"}`), Meta: testMeta()}, noProgress)
	if err != nil || !strings.Contains(string(res.Output), "Echo: again") {
		t.Fatalf("echo after the cancelled operation: %s, %v", res.Output, err)
	}
}
