package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// The registry with toolrunner's own openers runs a real MCP server over stdio (the test
// server, internal/mcptest): it lists its tools as ev__<tool>, validates arguments
// against their schemas, runs calls with progress, caps their output, and lists again
// when the server adds a tool.
func TestRegistryWithMCPStdio(t *testing.T) {
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "curfew-mcptest")
	build := exec.Command("go", "build", "-o", bin, "./internal/mcptest/cmd/curfew-mcptest")
	build.Dir = repo
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building curfew-mcptest: %v\n%s", err, out)
	}
	file := filepath.Join(t.TempDir(), "tools.json")
	if err := os.WriteFile(file, []byte(`{"sources": [{"name": "ev", "kind": "mcp_stdio", "command": "`+bin+`",
	  "tools": {"big": {"max_output_bytes": 500}, "wait": {"side_effects": "none"}}}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := registry.Load(file)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := registry.New(cfg, registry.Options{Openers: openers(nil), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := reg.Close(); err != nil {
			t.Error(err)
		}
	}()
	listed := func(name string) bool {
		for _, tl := range reg.Tools("") {
			if tl.Name == name {
				return true
			}
		}
		return false
	}
	waitFor(t, "the server's tools", func() bool { return listed("ev__echo") && listed("ev__add_tool") })

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	run := func(name, args string, progress func(*meshv1.Progress)) (source.Result, error) {
		p, err := reg.Prepare("", name, []byte(args))
		if err != nil {
			return source.Result{}, err
		}
		if progress == nil {
			progress = func(*meshv1.Progress) {}
		}
		return p.Run(ctx, source.Meta{RunID: "r1", NodeID: "root/s0.t0", RetryID: "x", Attempt: 1}, progress)
	}
	if _, err := run("ev__echo", `{"text": 5}`, nil); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "args.text") {
		t.Errorf("echo with a number: %v, want INVALID_ARGUMENT naming args.text", err)
	}
	res, err := run("ev__echo", `{"text": "hello"}`, nil)
	if err != nil || res.IsError || !strings.Contains(string(res.Output), `"hello"`) {
		t.Fatalf("echo: %+v %v", res, err)
	}
	if _, err := run("ev__big", `{"bytes": 2000}`, nil); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "max_output_bytes (500)") {
		t.Errorf("big: %v, want FAILED_PRECONDITION naming the cap", err)
	}
	var reports atomic.Int32
	if _, err := run("ev__wait", `{"ms": 300, "progress_ms": 30}`, func(*meshv1.Progress) { reports.Add(1) }); err != nil {
		t.Fatalf("wait: %v", err)
	}
	if reports.Load() == 0 {
		t.Error("wait: no progress reported")
	}
	if _, err := run("ev__add_tool", `{"name": "fresh"}`, nil); err != nil {
		t.Fatalf("add_tool: %v", err)
	}
	waitFor(t, "the added tool", func() bool { return listed("ev__fresh") })
	if res, err := run("ev__fresh", `{"text": "again"}`, nil); err != nil || !strings.Contains(string(res.Output), "again") {
		t.Errorf("the added tool: %+v %v", res, err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

// A gRPC tool source at an address nothing listens on is down: its tools fail
// UNAVAILABLE with the reason and toolrunner keeps listing it; once a ToolService serves
// there, its tools appear, with the side effects a trusted source claims, and run.
func TestRegistryWithGRPCDownThenUp(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close() // nothing listens there until the server starts below
	cfg, err := registry.Parse([]byte(`{"sources": [{"name": "team", "kind": "grpc", "address": "`+addr+`", "trusted": true}]}`),
		os.LookupEnv, exec.LookPath)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := registry.New(cfg, registry.Options{Openers: openers(nil), Logger: slog.New(slog.DiscardHandler),
		Breaker: breaker.Config{OpenTimeout: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reg.Close() }()
	waitFor(t, "the source to be reported down", func() bool {
		_, err := reg.Prepare("", "team__lookup", nil)
		// Down for a reason of the listing's own, not merely not listed yet.
		return status.Code(err) == codes.Unavailable && strings.Contains(err.Error(), "source team is down") &&
			!strings.Contains(err.Error(), "not listed yet")
	})
	_, err = reg.Prepare("", "team__lookup", nil)
	t.Logf("while down: %v", err)

	srv := toolserver.New(toolserver.Tool{Name: "lookup", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
		InputSchema: json.RawMessage(`{"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}`),
		Handler: func(_ context.Context, c toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
			return json.RawMessage(`{"run":"` + c.RunID + `"}`), nil
		}})
	lis, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the port was taken meanwhile: %v", err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	var lookup registry.Tool
	waitFor(t, "the source's tools", func() bool {
		for _, tl := range reg.Tools("") {
			if tl.Name == "team__lookup" {
				lookup = tl
				return true
			}
		}
		return false
	})
	if lookup.SideEffects != catalog.None {
		t.Errorf("a trusted source's SIDE_EFFECTS_NONE resolved to %v", lookup.SideEffects)
	}
	if _, err := reg.Prepare("", "team__lookup", []byte(`{}`)); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "'id'") {
		t.Errorf("missing id: %v", err)
	}
	p, err := reg.Prepare("", "team__lookup", []byte(`{"id": "o-1"}`))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := p.Run(ctx, source.Meta{RunID: "r-grpc", NodeID: "root/s0.t0", RetryID: "x", Attempt: 1, Deadline: time.Now().Add(10 * time.Second)}, func(*meshv1.Progress) {})
	if err != nil || string(res.Output) != `{"run":"r-grpc"}` {
		t.Fatalf("lookup: %s %v", res.Output, err)
	}
}
