package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/internal/mcptest"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// transports runs each test over stdio and over streamable HTTP.
var transports = []struct {
	name string
	open func(*testing.T, *lateCounter) (*Source, string)
}{
	{"stdio", openStdio},
	{"http", openHTTP},
}

func noProgress(*meshv1.Progress) {}

func testMeta() source.Meta {
	return source.Meta{
		Deadline: time.Now().Add(time.Minute).Truncate(time.Millisecond),
		RunID:    "run-1", NodeID: "root/tool", RetryID: "retry-1", Attempt: 1,
	}
}

func TestListAndEcho(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, _ := tr.open(t, &lateCounter{})
			tools, err := s.List(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, tool := range tools {
				names = append(names, tool.Name)
			}
			slices.Sort(names)
			if want := []string{"add_tool", "big", "drop", "echo", "effect", "stubborn", "wait"}; !slices.Equal(names, want) {
				t.Fatalf("tools %v, want %v", names, want)
			}
			echo := tools[slices.IndexFunc(tools, func(t source.Tool) bool { return t.Name == "echo" })]
			drop := tools[slices.IndexFunc(tools, func(t source.Tool) bool { return t.Name == "drop" })]
			// destructiveHint: absent is not said (nil), explicit true is.
			if echo.Hints.Destructive != nil || drop.Hints.Destructive == nil || !*drop.Hints.Destructive {
				t.Fatalf("destructive hints: echo %v, drop %v; want nil and true", echo.Hints.Destructive, drop.Hints.Destructive)
			}
			var schema struct {
				Type       string                     `json:"type"`
				Properties map[string]json.RawMessage `json:"properties"`
			}
			if err := json.Unmarshal(echo.InputSchema, &schema); err != nil || schema.Type != "object" || schema.Properties["text"] == nil {
				t.Fatalf("echo's input schema %s (%v): want an object with property text", echo.InputSchema, err)
			}

			res, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"hello"}`), Meta: testMeta()}, noProgress)
			if err != nil {
				t.Fatal(err)
			}
			var blocks []struct{ Type, Text string }
			if err := json.Unmarshal(res.Output, &blocks); err != nil || len(blocks) != 1 || blocks[0] != (struct{ Type, Text string }{"text", "hello"}) || res.IsError {
				t.Fatalf("echo: %+v (%s), want one text block hello", res, res.Output)
			}
		})
	}
}

func TestMetaAndStructuredResult(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, record := tr.open(t, &lateCounter{})
			meta := testMeta()
			meta.IdempotencyKey = "key-" + tr.name
			sent := time.Now()
			for want := 1; want <= 2; want++ {
				res, err := s.Call(t.Context(), source.Call{Tool: "effect", Meta: meta}, noProgress)
				if err != nil {
					t.Fatal(err)
				}
				var out struct {
					Key     string
					Calls   int
					Effects int
				}
				if err := json.Unmarshal(res.Output, &out); err != nil || out.Key != meta.IdempotencyKey || out.Calls != want || out.Effects != 1 {
					t.Fatalf("effect call %d: output %s (%v), want key %s, %d calls, 1 effect", want, res.Output, err, meta.IdempotencyKey, want)
				}
			}
			rec := waitRecord(t, record, 5*time.Second, func(r mcptest.Record) bool { return r.Tool == "effect" })
			if rec.MetaError != "" {
				t.Fatalf("the server found the _meta malformed: %s", rec.MetaError)
			}
			got := rec.Meta
			if got.Deadline != meta.Deadline.UnixMilli() || got.RunID != meta.RunID || got.NodeID != meta.NodeID ||
				got.RetryID != meta.RetryID || got.IdempotencyKey != meta.IdempotencyKey {
				t.Fatalf("server saw %+v, want the call's %+v", got, meta)
			}
			// timeout_ms is what was left when the call was sent: at most a minute, and
			// not less than what was left a little before sending.
			if left := meta.Deadline.Sub(sent).Milliseconds(); got.TimeoutMS > time.Minute.Milliseconds() || got.TimeoutMS < left-5000 {
				t.Fatalf("timeout_ms %d, want about %d", got.TimeoutMS, left)
			}

			// No key: the tool fails in its own terms, which is a result, not an error.
			res, err := s.Call(t.Context(), source.Call{Tool: "effect", Meta: testMeta()}, noProgress)
			if err != nil {
				t.Fatal(err)
			}
			if !res.IsError || !strings.Contains(res.Text, "idempotency_key") {
				t.Fatalf("effect without a key: %+v, want IsError with the reason", res)
			}
		})
	}
}

// TestCancelEndsTheServersCall: cancelling Call's ctx returns at once and, through the
// SDK's notifications/cancelled, ends the tool's context on the server.
func TestCancelEndsTheServersCall(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, record := tr.open(t, &lateCounter{})
			ctx, cancel := context.WithCancel(t.Context())
			first := make(chan struct{})
			var once sync.Once
			progress := func(*meshv1.Progress) { once.Do(func() { close(first) }) }
			done := make(chan error, 1)
			var returned time.Time
			go func() {
				_, err := s.Call(ctx, source.Call{Tool: "wait", Args: json.RawMessage(`{"ms":60000,"progress_ms":50}`), Meta: testMeta()}, progress)
				returned = time.Now()
				done <- err
			}()
			select {
			case <-first:
			case <-time.After(10 * time.Second):
				t.Fatal("no progress from wait within 10s")
			}
			cancelled := time.Now()
			cancel()
			var err error
			select {
			case err = <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("Call did not return within 5s of the cancel")
			}
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Call: %v, want context.Canceled", err)
			}
			if took := returned.Sub(cancelled); took > 2*time.Second {
				t.Fatalf("Call returned %v after the cancel, want promptly", took)
			}
			rec := waitRecord(t, record, 10*time.Second, func(r mcptest.Record) bool { return r.Tool == "wait" })
			if rec.CtxDoneNS == 0 {
				t.Fatalf("the server's wait returned without its context ending: %+v", rec)
			}
			if lag := time.Unix(0, rec.CtxDoneNS).Sub(cancelled); lag > 5*time.Second {
				t.Fatalf("the server's context ended %v after the cancel", lag)
			}
			if rec.Progress == 0 {
				t.Fatalf("the record shows no progress sent: %+v", rec)
			}
		})
	}
}

// TestStubbornToolProgressAfterReturnIsLate: a tool that ignores the cancel goes on
// reporting progress; none of it reaches the callback after Call returned, and what
// arrives is counted as late.
func TestStubbornToolProgressAfterReturnIsLate(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			late := &lateCounter{}
			s, record := tr.open(t, late)
			ctx, cancel := context.WithCancel(t.Context())
			var returned atomic.Bool
			var afterReturn, delivered atomic.Int32
			first := make(chan struct{})
			var once sync.Once
			progress := func(*meshv1.Progress) {
				if returned.Load() {
					afterReturn.Add(1)
				}
				delivered.Add(1)
				once.Do(func() { close(first) })
			}
			done := make(chan error, 1)
			go func() {
				_, err := s.Call(ctx, source.Call{Tool: "stubborn", Args: json.RawMessage(`{"ms":1500,"progress_ms":20}`), Meta: testMeta()}, progress)
				returned.Store(true)
				done <- err
			}()
			select {
			case <-first:
			case <-time.After(10 * time.Second):
				t.Fatal("no progress from stubborn within 10s")
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
				t.Fatalf("Call returned %v after the cancel of a 1.5s tool, want promptly", took)
			}
			rec := waitRecord(t, record, 10*time.Second, func(r mcptest.Record) bool { return r.Tool == "stubborn" })
			// The server sent its last report before its record; give it time to arrive.
			time.Sleep(200 * time.Millisecond)
			if n := afterReturn.Load(); n != 0 {
				t.Fatalf("%d progress reports reached the callback after Call returned", n)
			}
			t.Logf("server sent %d reports, %d delivered, %d counted late", rec.Progress, delivered.Load(), late.get())
			if got := int(delivered.Load()) + late.get(); got > rec.Progress {
				t.Fatalf("%d delivered + %d late > %d sent", delivered.Load(), late.get(), rec.Progress)
			}
			// Over stdio every report arrives: those after the return are late. Over HTTP
			// the reports go on the call's response stream, which the cancel closed, so
			// the server may not be able to send them at all.
			if tr.name == "stdio" {
				if late.get() == 0 || int(delivered.Load())+late.get() != rec.Progress {
					t.Fatalf("stdio: %d delivered + %d late, want all %d sent with some late", delivered.Load(), late.get(), rec.Progress)
				}
			}
			// The session is still good.
			if _, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"x"}`), Meta: testMeta()}, noProgress); err != nil {
				t.Fatalf("echo after the stubborn call: %v", err)
			}
		})
	}
}

func TestTooLarge(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, _ := tr.open(t, &lateCounter{})
			limit := testOptions(t, nil).MaxMessageBytes
			res, err := s.Call(t.Context(), source.Call{Tool: "big", Args: json.RawMessage(`{"bytes":32768}`), Meta: testMeta()}, noProgress)
			if err != nil || len(res.Output) < 32768 {
				t.Fatalf("big under the limit: %d bytes, %v", len(res.Output), err)
			}
			args, _ := json.Marshal(map[string]int{"bytes": limit + 1})
			_, err = s.Call(t.Context(), source.Call{Tool: "big", Args: args, Meta: testMeta()}, noProgress)
			if !errors.Is(err, source.ErrTooLarge) || status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("big over the limit: %v (code %v), want ResourceExhausted wrapping ErrTooLarge", err, status.Code(err))
			}
			if !strings.Contains(err.Error(), "mcptest") {
				t.Fatalf("error %q does not name the source", err)
			}
			// Over stdio the session ended and the process restarts; HTTP keeps it.
			waitUp(t, s, 15*time.Second)
			if _, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"x"}`), Meta: testMeta()}, noProgress); err != nil {
				t.Fatalf("echo after the oversized answer: %v", err)
			}
		})
	}
}

// TestStdioServerKilled: kill -9 of the server fails the call in flight UNAVAILABLE; the
// source restarts the process, says so on Changed, and the next call succeeds.
func TestStdioServerKilled(t *testing.T) {
	s, _ := openStdio(t, &lateCounter{})
	s.mu.Lock()
	pid := s.sess.pid
	s.mu.Unlock()
	changed := s.Changed()
	started := make(chan struct{})
	var once sync.Once
	done := make(chan error, 1)
	go func() {
		_, err := s.Call(t.Context(), source.Call{Tool: "wait", Args: json.RawMessage(`{"ms":60000,"progress_ms":50}`), Meta: testMeta()},
			func(*meshv1.Progress) { once.Do(func() { close(started) }) })
		done <- err
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("wait did not start within 10s")
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "mcptest") {
			t.Fatalf("call in flight: %v, want UNAVAILABLE naming the source", err)
		}
		t.Logf("call in flight: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the call in flight did not fail within 10s of the kill")
	}
	select {
	case <-changed:
	case <-time.After(15 * time.Second):
		t.Fatal("Changed not closed within 15s of the kill")
	}
	res, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"again"}`), Meta: testMeta()}, noProgress)
	if err != nil || !strings.Contains(string(res.Output), "again") {
		t.Fatalf("echo after the restart: %s, %v", res.Output, err)
	}
	s.mu.Lock()
	newPid := s.sess.pid
	s.mu.Unlock()
	if newPid == pid {
		t.Fatalf("the process was not restarted (pid %d)", pid)
	}
	// The killed process was reaped, and Close stops and reaps the new one.
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("kill -0 of the old pid %d: %v, want ESRCH (reaped)", pid, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(newPid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("kill -0 of pid %d after Close: %v, want ESRCH (stopped and reaped)", newPid, err)
	}
	if _, err := s.List(t.Context()); status.Code(err) != codes.Unavailable {
		t.Fatalf("List after Close: %v, want UNAVAILABLE", err)
	}
}

// TestHTTPServerDownAtOpen: a server that is not up yet makes Open succeed and calls
// fail UNAVAILABLE; once it starts, the source connects and says so on Changed.
func TestHTTPServerDownAtOpen(t *testing.T) {
	addr := freeAddr(t)
	s, err := OpenHTTP(t.Context(), HTTPConfig{Name: "later", URL: "http://" + addr + "/mcp"}, testOptions(t, &lateCounter{}))
	if err != nil {
		t.Fatalf("Open with the server down: %v", err)
	}
	defer func() { _ = s.Close() }()
	changed := s.Changed()
	_, err = s.List(t.Context())
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `"later"`) {
		t.Fatalf("List with the server down: %v, want UNAVAILABLE naming the source", err)
	}
	_, err = s.Call(t.Context(), source.Call{Tool: "echo", Meta: testMeta()}, noProgress)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("Call with the server down: %v, want UNAVAILABLE", err)
	}
	t.Logf("down: %v", err)
	startHTTPServer(t, addr, t.TempDir()+"/record.jsonl")
	select {
	case <-changed:
	case <-time.After(15 * time.Second):
		t.Fatal("Changed not closed within 15s of the server starting")
	}
	res, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"up"}`), Meta: testMeta()}, noProgress)
	if err != nil || !strings.Contains(string(res.Output), "up") {
		t.Fatalf("echo once the server is up: %s, %v", res.Output, err)
	}
}

func TestOpenConfigurationErrors(t *testing.T) {
	opts := Options{Logger: testLogger(t)}
	if _, err := OpenStdio(t.Context(), StdioConfig{Name: "x", Command: "/nonexistent/curfew-no-such-server"}, opts); err == nil || !strings.Contains(err.Error(), "curfew-no-such-server") {
		t.Fatalf("missing command: %v, want an error naming it", err)
	}
	if _, err := OpenStdio(t.Context(), StdioConfig{Name: "x", Command: "curfew-no-such-server-on-path"}, opts); err == nil {
		t.Fatal("a command not on PATH opened")
	}
	if _, err := OpenStdio(t.Context(), StdioConfig{Name: "x", Command: t.TempDir()}, opts); err == nil {
		t.Fatal("a directory opened as a command")
	}
	if _, err := OpenHTTP(t.Context(), HTTPConfig{Name: "x", URL: "ftp://host/"}, opts); err == nil || !strings.Contains(err.Error(), "url") {
		t.Fatalf("ftp URL: %v, want an error about the url", err)
	}
}

// TestHTTPServerRestarted: a server that goes away fails the call in flight UNAVAILABLE;
// when it is back (a new process, which knows nothing of the old session) the source
// opens a new session and calls succeed again.
func TestHTTPServerRestarted(t *testing.T) {
	addr := freeAddr(t)
	record := t.TempDir() + "/record.jsonl"
	server := startHTTPServer(t, addr, record)
	s, err := OpenHTTP(t.Context(), HTTPConfig{Name: "restarts", URL: "http://" + addr + "/"}, testOptions(t, &lateCounter{}))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	started := make(chan struct{})
	var once sync.Once
	done := make(chan error, 1)
	go func() {
		_, err := s.Call(t.Context(), source.Call{Tool: "wait", Args: json.RawMessage(`{"ms":60000,"progress_ms":50}`), Meta: testMeta()},
			func(*meshv1.Progress) { once.Do(func() { close(started) }) })
		done <- err
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("wait did not start within 10s")
	}
	if err := server.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("call in flight: %v, want UNAVAILABLE", err)
		}
		t.Logf("call in flight: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the call in flight did not fail within 10s of the kill")
	}
	startHTTPServer(t, addr, record)
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := s.Call(t.Context(), source.Call{Tool: "echo", Args: json.RawMessage(`{"text":"back"}`), Meta: testMeta()}, noProgress)
		if err == nil {
			break
		}
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("echo while reconnecting: %v, want UNAVAILABLE until it works", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("echo still failing 30s after the server restarted: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestListChanged: a server that adds a tool says so, Changed is closed, and List has it.
func TestListChanged(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, _ := tr.open(t, &lateCounter{})
			changed := s.Changed()
			res, err := s.Call(t.Context(), source.Call{Tool: "add_tool", Args: json.RawMessage(`{"name":"echo2"}`), Meta: testMeta()}, noProgress)
			if err != nil || res.IsError {
				t.Fatalf("add_tool: %+v, %v", res, err)
			}
			select {
			case <-changed:
			case <-time.After(10 * time.Second):
				t.Fatal("Changed not closed within 10s of the server adding a tool")
			}
			if s.Changed() == changed {
				t.Fatal("Changed returned the closed channel again")
			}
			tools, err := s.List(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if !slices.ContainsFunc(tools, func(t source.Tool) bool { return t.Name == "echo2" }) {
				t.Fatalf("tools %v: want echo2 after the change", tools)
			}
		})
	}
}
