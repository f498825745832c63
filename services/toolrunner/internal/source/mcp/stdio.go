package mcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// StdioConfig is an MCP server the source runs as a process and talks to over its
// stdin and stdout (newline-delimited JSON-RPC).
type StdioConfig struct {
	// Name names the source in errors and logs.
	Name string
	// Command is the program: a path, or a name looked up in PATH when Open runs.
	Command string
	Args    []string
	// Env is the process's whole environment, already resolved ("K=V"); nil is an
	// empty environment, so nothing of the toolrunner's own leaks into the server.
	Env []string
	// Dir is the working directory; empty is the toolrunner's.
	Dir string
}

// stopGrace is how long Close lets a stdio server exit on SIGTERM before SIGKILL.
const stopGrace = 2 * time.Second

// OpenStdio starts the server and returns its source. A command that cannot be found or
// started, or a Dir that does not exist, is an error; a server that fails its handshake
// or exits leaves the source down (UNAVAILABLE) and restarting it with backoff.
func OpenStdio(ctx context.Context, cfg StdioConfig, opts Options) (*Source, error) {
	if cfg.Name == "" {
		return nil, errors.New("mcp: stdio source: name is empty")
	}
	if cfg.Command == "" {
		return nil, fmt.Errorf("mcp source %q: command is empty", cfg.Name)
	}
	if cfg.Dir != "" {
		if fi, err := os.Stat(cfg.Dir); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("mcp source %q: dir %q is not a directory", cfg.Name, cfg.Dir)
		}
	}
	path := cfg.Command
	if cfg.Dir != "" && strings.ContainsRune(path, filepath.Separator) && !filepath.IsAbs(path) {
		path = filepath.Join(cfg.Dir, path)
	}
	path, err := exec.LookPath(path)
	if err != nil {
		return nil, fmt.Errorf("mcp source %q: command %q: %w", cfg.Name, cfg.Command, err)
	}
	cfg.Command = path
	if err := probeStart(cfg); err != nil {
		return nil, fmt.Errorf("mcp source %q: command %q: %w", cfg.Name, cfg.Command, err)
	}
	s := newSource(cfg.Name, opts, func(s *Source) func(context.Context) (*session, error) {
		return func(ctx context.Context) (*session, error) { return s.startProcess(ctx, cfg) }
	})
	s.start(ctx)
	return s, nil
}

// probeStart checks that the command can be executed at all, without running it: the
// file must be a regular file the toolrunner may execute.
func probeStart(cfg StdioConfig) error {
	fi, err := os.Stat(cfg.Command)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return errors.New("not a regular file")
	}
	return syscall.Access(cfg.Command, 0x1) // X_OK
}

// startProcess starts the server and opens an MCP session over its pipes.
func (s *Source) startProcess(ctx context.Context, cfg StdioConfig) (*session, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		_ = inR.Close()
		_ = inW.Close()
		return nil, err
	}
	cmd := exec.Command(cfg.Command, cfg.Args...) //nolint:gosec,noctx // the operator configures the command; the session, not a ctx, decides when it stops
	cmd.Env = cfg.Env
	if cmd.Env == nil {
		cmd.Env = []string{}
	}
	cmd.Dir = cfg.Dir
	cmd.Stdin, cmd.Stdout = inR, outW
	stderr := &stderrTail{log: func(line string) { s.opts.Logger.Debug("mcp server stderr", "source", s.name, "line", line) }}
	cmd.Stderr = stderr
	cmd.WaitDelay = stopGrace // a grandchild holding stderr open must not block Wait
	// Its own process group, so that stopping it stops what it started.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	_ = inR.Close() // the child's ends; the child holds its own copies
	_ = outW.Close()
	if err != nil {
		_ = inW.Close()
		_ = outR.Close()
		return nil, fmt.Errorf("starting %s: %w", cfg.Command, err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()

	sess := &session{done: make(chan struct{})}
	reader := &lineLimit{r: outR, max: s.opts.MaxMessageBytes, tooLarge: &sess.tooLarge}
	transport := &sdk.IOTransport{
		Reader: reader,
		Writer: inW,
		// The SDK's own frame limit stays as a backstop above ours, for a server that
		// breaks one message over several lines.
		MaxLineLength: 2*s.opts.MaxMessageBytes + 1<<16,
	}
	kill := func(sig syscall.Signal) { _ = syscall.Kill(-cmd.Process.Pid, sig) }
	cs, err := s.client.Connect(ctx, transport, nil)
	if err != nil {
		kill(syscall.SIGKILL)
		_ = inW.Close()
		_ = outR.Close()
		exit := <-waited
		if ctx.Err() == nil && exit != nil {
			return nil, fmt.Errorf("MCP handshake: %w (process %w%s)", err, exit, stderr.tail())
		}
		return nil, fmt.Errorf("MCP handshake: %w%s", err, stderr.tail())
	}
	sess.cs, sess.pid = cs, cmd.Process.Pid

	connEnded := make(chan struct{})
	go func() {
		_ = cs.Wait()
		close(connEnded)
	}()
	// Whichever ends first, the process or the connection, the other follows: a process
	// with a broken session is of no use, and its restart is the only way back.
	go func() {
		var exit error
		exited := false
		select {
		case exit = <-waited:
			exited = true
		case <-connEnded:
		}
		kill(syscall.SIGKILL)
		_ = cs.Close()
		if !exited {
			exit = <-waited
		}
		<-connEnded
		reason := "process exited"
		if exit != nil {
			reason = "process " + exit.Error()
		}
		if sess.tooLarge.Load() {
			reason = fmt.Sprintf("%v: the server sent a message over %d bytes; %s", source.ErrTooLarge, s.opts.MaxMessageBytes, reason)
		}
		sess.err = errors.New(reason + stderr.tail())
		close(sess.done)
	}()
	var endOnce sync.Once
	sess.end = func() {
		endOnce.Do(func() {
			kill(syscall.SIGTERM)
			select {
			case <-sess.done:
			case <-time.After(stopGrace):
				kill(syscall.SIGKILL)
			}
		})
		<-sess.done
	}
	return sess, nil
}

// lineLimit passes a stdio server's output through while no line (one JSON-RPC
// message) is longer than max bytes; past that it marks tooLarge and fails every
// read, which ends the session.
type lineLimit struct {
	r        io.ReadCloser
	max      int
	line     int // bytes since the last newline
	tooLarge interface{ Store(bool) }
	err      error
}

func (l *lineLimit) Read(p []byte) (int, error) {
	if l.err != nil {
		return 0, l.err
	}
	n, err := l.r.Read(p)
	for _, b := range p[:n] {
		if b == '\n' {
			l.line = 0
			continue
		}
		l.line++
		if l.line > l.max {
			l.tooLarge.Store(true)
			l.err = fmt.Errorf("%w: a line of the server's output is over %d bytes", source.ErrTooLarge, l.max)
			return 0, l.err
		}
	}
	return n, err
}

func (l *lineLimit) Close() error { return l.r.Close() }

// stderrTail logs a server's stderr line by line and keeps its last lines for the
// reason a session ended.
type stderrTail struct {
	log     func(string)
	mu      sync.Mutex
	partial []byte
	last    []string
}

const (
	stderrKeep     = 5
	stderrLineMax  = 512
	stderrTotalMax = 4096
)

func (t *stderrTail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, b := range p {
		if b != '\n' {
			if len(t.partial) < stderrLineMax {
				t.partial = append(t.partial, b)
			}
			continue
		}
		line := string(t.partial)
		t.partial = t.partial[:0]
		t.log(line)
		t.last = append(t.last, line)
		if len(t.last) > stderrKeep {
			t.last = t.last[1:]
		}
	}
	return len(p), nil
}

// tail returns "; stderr: ..." with the last lines, or "".
func (t *stderrTail) tail() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	lines := t.last
	if len(t.partial) > 0 {
		lines = append(lines[:len(lines):len(lines)], string(t.partial))
	}
	if len(lines) == 0 {
		return ""
	}
	s := strings.Join(lines, " | ")
	if len(s) > stderrTotalMax {
		s = s[len(s)-stderrTotalMax:]
	}
	return "; stderr: " + s
}
