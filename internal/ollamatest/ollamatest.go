// Package ollamatest runs a real OpenAI-compatible inference server for tests: ollama
// (v0.6.8, built by scripts/ollama.sh) on loopback, serving a tiny random-weight llama model
// that internal/tinygguf writes. It is not a handler written for the tests: requests go
// through ollama's OpenAI layer, its scheduler and a llama.cpp runner subprocess that really
// decodes, one token at a time, on one thread.
//
// The helper also shows the server's side of a request, which a client cannot see on its
// own:
//
//   - Requests: ollama's access log (gin) writes one line per request when the handler
//     returns, with the status and the handler's duration. The instant that line reaches us
//     is when the server finished the request: for a streaming completion whose client went
//     away, when ollama noticed and stopped the sequence.
//   - RunnerCPU: the CPU time of the runner subprocess (the decoder), from /proc. While it
//     decodes it climbs at about one CPU-second per second; once generation stops it is flat.
//
// The binary comes from CURFEW_OLLAMA (scripts/test.sh sets it from scripts/ollama.sh).
// Without it the tests that need the server skip locally and fail in CI (CI=true), so they
// never pass silently there.
package ollamatest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/tinygguf"
)

// EnvBinary names the variable holding the path of the ollama binary.
const EnvBinary = "CURFEW_OLLAMA"

// ModelName is the name the model is created under.
const ModelName = "tiny"

// Binary returns the ollama binary from CURFEW_OLLAMA. When it is unset the test is
// skipped, except in CI (CI=true) where it fails: those tests must not pass by skipping.
func Binary(t testing.TB) string {
	t.Helper()
	bin := os.Getenv(EnvBinary)
	if bin == "" {
		msg := EnvBinary + " is not set: this test needs a real ollama server " +
			"(export " + EnvBinary + "=$(bash scripts/ollama.sh); scripts/test.sh does it)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		t.Fatalf("%s=%s is not an executable file (%v)", EnvBinary, bin, err)
	}
	return bin
}

// Request is one request as the server's access log recorded it.
type Request struct {
	Ended   time.Time     // when the log line arrived: the server had finished the request
	Status  int           // HTTP status
	Latency time.Duration // the handler's own duration
	Method  string
	Path    string
}

// Options tune Start.
type Options struct {
	// Seed of the model's weights (default 1).
	Seed uint64
	// Threads is the runner's num_thread (default 1, what this 2-core machine affords).
	Threads int
	// Env is added to the server's environment.
	Env []string
	// Model overrides the model's shape (tinygguf's defaults where zero; Seed applies when
	// Model.Seed is 0).
	Model tinygguf.Config
}

// Server is a running ollama with the tiny model created.
type Server struct {
	Host    string // 127.0.0.1:port
	BaseURL string // the OpenAI base URL, http://127.0.0.1:port/v1
	Model   string // the model's name (ModelName)
	Dir     string // scratch directory: HOME, models, the model file, the server log

	bin  string
	cmd  *exec.Cmd
	done chan struct{} // closed when the server process has been waited for
	log  *os.File      // the server's full log, for a failed test

	mu       sync.Mutex
	cond     *sync.Cond
	requests []Request
	closed   bool
	stopOnce sync.Once
	stopErr  error
}

// gin's default access log line, e.g.
// [GIN] 2025/05/09 - 10:00:00 | 200 |  1.234567s |  127.0.0.1 | POST  "/v1/chat/completions"
var ginLine = regexp.MustCompile(`^\[GIN\] [^|]*\|\s*(\d+)\s*\|\s*(\S+)\s*\|\s*\S+\s*\|\s*(\S+)\s+"([^"]*)"`)

// Start starts ollama serve on a free loopback port with HOME and OLLAMA_MODELS in a fresh
// scratch directory, waits until it answers, creates the tiny model with a Modelfile
// (num_thread 1) and loads it with a one-token warm-up. The server is stopped, runner
// included, when the test ends.
func Start(t testing.TB, o Options) *Server {
	t.Helper()
	bin := Binary(t)
	s, err := start(bin, t.TempDir(), o)
	if s != nil {
		t.Cleanup(func() {
			if t.Failed() {
				s.dumpLog(t)
			}
			if err := s.Stop(); err != nil {
				t.Errorf("ollama: stop: %v", err)
			}
		})
	}
	if err != nil {
		t.Fatalf("ollama: %v", err)
	}
	return s
}

func start(bin, dir string, o Options) (*Server, error) {
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Threads == 0 {
		o.Threads = 1
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &Server{
		Host: fmt.Sprintf("127.0.0.1:%d", port), Model: ModelName, Dir: dir, bin: bin,
		done: make(chan struct{}),
	}
	s.BaseURL = "http://" + s.Host + "/v1"
	s.cond = sync.NewCond(&s.mu)
	if s.log, err = os.Create(filepath.Join(dir, "ollama.log")); err != nil {
		return nil, err
	}

	s.cmd = exec.Command(bin, "serve") //nolint:noctx // Stop ends it: SIGTERM first, so it unloads its runner
	s.cmd.Dir = dir
	s.cmd.Env = s.env(o.Env)
	// Its own process group, so Stop can end the runner it spawns too; and if this test
	// process dies, the server gets SIGTERM (and stops its runner).
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	s.cmd.Stdout, s.cmd.Stderr = pw, pw
	if err := s.cmd.Start(); err != nil {
		_ = pr.Close()
		_ = pw.Close()
		return nil, err
	}
	_ = pw.Close()
	logDone := make(chan struct{})
	go s.readLog(pr, logDone)
	go func() {
		_ = s.cmd.Wait()
		<-logDone
		close(s.done)
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.waitReady(ctx); err != nil {
		return s, err
	}
	if err := s.createModel(ctx, o); err != nil {
		return s, err
	}
	// Load the model now (the runner starts on the first request), so tests time decoding,
	// not loading.
	if err := s.warmUp(ctx); err != nil {
		return s, err
	}
	return s, nil
}

func (s *Server) env(extra []string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "OLLAMA_") || strings.HasPrefix(kv, "HOME=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env,
		"HOME="+s.Dir,
		"OLLAMA_HOST="+s.Host,
		"OLLAMA_MODELS="+filepath.Join(s.Dir, "models"),
		"OLLAMA_NUM_PARALLEL=1", // one sequence at a time: the runner's CPU is one decode
		"OLLAMA_MAX_LOADED_MODELS=1",
		"OLLAMA_KEEP_ALIVE=30m",   // the runner stays loaded for the whole test
		"CUDA_VISIBLE_DEVICES=-1", // no accelerator here; skip the probing
		"HIP_VISIBLE_DEVICES=-1",
	)
}

// readLog copies the server's output to the log file and records the access-log lines.
func (s *Server) readLog(r io.ReadCloser, done chan<- struct{}) {
	defer close(done)
	defer func() { _ = r.Close() }()
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		now := time.Now()
		line := sc.Text()
		_, _ = fmt.Fprintf(s.log, "%s %s\n", now.Format("15:04:05.000000"), line)
		m := ginLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		status, _ := strconv.Atoi(m[1])
		lat, _ := time.ParseDuration(m[2])
		s.mu.Lock()
		s.requests = append(s.requests, Request{Ended: now, Status: status, Latency: lat, Method: m[3], Path: m[4]})
		s.cond.Broadcast()
		s.mu.Unlock()
	}
	s.mu.Lock()
	s.closed = true
	s.cond.Broadcast()
	s.mu.Unlock()
}

// Requests returns the requests the server has finished so far, in order.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// WaitRequest waits for the server to finish a request to path (a method and path, like
// "POST /v1/chat/completions") whose log line arrived after the instant since, and returns
// it. Pass the instant just before the request was sent.
func (s *Server) WaitRequest(ctx context.Context, path string, since time.Time) (Request, error) {
	method, p, ok := strings.Cut(path, " ")
	if !ok {
		method, p = "", path
	}
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		for _, r := range s.requests {
			if r.Ended.After(since) && r.Path == p && (method == "" || r.Method == method) {
				return r, nil
			}
		}
		if s.closed {
			return Request{}, errors.New("ollama: the server exited")
		}
		if err := ctx.Err(); err != nil {
			return Request{}, fmt.Errorf("ollama: no finished %s in the log: %w", path, err)
		}
		s.cond.Wait()
	}
}

// RunnerPIDs returns the server's child processes: the runners that hold loaded models.
func (s *Server) RunnerPIDs() []int {
	if s.cmd == nil || s.cmd.Process == nil {
		return nil
	}
	return children(s.cmd.Process.Pid)
}

// RunnerCPU returns the CPU time its runners have used so far, summed over their threads,
// in nanoseconds where the kernel keeps per-thread run times (/proc/<pid>/task/*/schedstat)
// and in clock ticks (10 ms, /proc/<pid>/stat) where it does not. It errs when no runner is
// running. Compare two readings: the difference is the CPU the decoder used in between.
func (s *Server) RunnerCPU() (time.Duration, error) {
	pids := s.RunnerPIDs()
	if len(pids) == 0 {
		return 0, errors.New("ollama: no runner process")
	}
	var total time.Duration
	for _, pid := range pids {
		d, err := cpuTime(pid)
		if err != nil {
			return 0, err
		}
		total += d
	}
	return total, nil
}

// Stop ends the server: SIGTERM (it unloads its runners), then SIGKILL to its process group
// after 10 s. It returns once the server has exited and no runner it started is left.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() { s.stopErr = s.stop() })
	return s.stopErr
}

func (s *Server) stop() error {
	defer func() { _ = s.log.Close() }()
	if s.cmd == nil || s.cmd.Process == nil {
		return nil
	}
	pid := s.cmd.Process.Pid
	runners := children(pid)
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	var err error
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		err = errors.New("ollama serve did not stop within 10s of SIGTERM; killed")
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		<-s.done
	}
	// Runners are in the server's process group; make sure none outlives it.
	deadline := time.Now().Add(5 * time.Second)
	for _, r := range runners {
		for alive(r) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if alive(r) {
			_ = syscall.Kill(r, syscall.SIGKILL)
			if err == nil {
				err = fmt.Errorf("ollama runner %d outlived the server; killed", r)
			}
		}
	}
	_ = syscall.Kill(-pid, syscall.SIGKILL) // anything else left in the group
	return err
}

func (s *Server) dumpLog(t testing.TB) {
	b, err := os.ReadFile(s.log.Name())
	if err != nil {
		return
	}
	const max = 16 << 10
	if len(b) > max {
		b = b[len(b)-max:]
	}
	t.Logf("ollama log (tail):\n%s", b)
}

func (s *Server) waitReady(ctx context.Context) error {
	c := &http.Client{Timeout: 2 * time.Second}
	defer c.CloseIdleConnections()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.Host+"/api/version", nil)
		if resp, err := c.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-s.done:
			return errors.New("ollama serve exited before it was ready")
		case <-ctx.Done():
			return fmt.Errorf("ollama serve not ready: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Modelfile is the recipe the model is created from: the GGUF file, one thread, and a plain
// chat template (the file has none). The template names the request's tools, which is how
// ollama tells a model that takes tools (it refuses tools to one whose template has no
// .Tools): curfew's agent loop offers its tools on every model step, as with a real model.
func Modelfile(gguf string, threads int) string {
	return fmt.Sprintf(`FROM %s
TEMPLATE """{{- if .Tools }}tools:{{ range .Tools }} {{ .Function.Name }}{{ end }}
{{ end }}{{- range .Messages }}{{ .Role }}: {{ .Content }}
{{ end }}assistant:"""
PARAMETER num_thread %d
PARAMETER num_ctx 2048
`, gguf, threads)
}

func (s *Server) createModel(ctx context.Context, o Options) error {
	gguf := filepath.Join(s.Dir, "tiny.gguf")
	mc := o.Model
	if mc.Seed == 0 {
		mc.Seed = o.Seed
	}
	if err := tinygguf.WriteFile(gguf, mc); err != nil {
		return err
	}
	mf := filepath.Join(s.Dir, "Modelfile")
	if err := os.WriteFile(mf, []byte(Modelfile(gguf, o.Threads)), 0o600); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, s.bin, "create", s.Model, "-f", mf)
	cmd.Dir = s.Dir
	cmd.Env = s.env(nil)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ollama create: %w\n%s", err, out)
	}
	return nil
}

func (s *Server) warmUp(ctx context.Context) error {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":1}`, s.Model)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.BaseURL+"/chat/completions", bytes.NewBufferString(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	c := &http.Client{}
	defer c.CloseIdleConnections()
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("warm-up: %s: %s", resp.Status, b)
	}
	if len(s.RunnerPIDs()) == 0 {
		return errors.New("warm-up: no runner process after a completion")
	}
	return nil
}

func freePort() (int, error) {
	l, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	return port, l.Close()
}

// children lists the processes whose parent is pid.
func children(pid int) []int {
	// /proc/<pid>/task/<tid>/children lists each thread's children (CONFIG_PROC_CHILDREN);
	// scanning /proc works everywhere.
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := stat(p)
		if err != nil || len(st) < 2 {
			continue
		}
		if ppid, _ := strconv.Atoi(st[1]); ppid == pid {
			out = append(out, p)
		}
	}
	return out
}

// stat returns /proc/<pid>/stat's fields after the command name: field 3 (state) first.
func stat(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, errors.New("malformed /proc stat")
	}
	return strings.Fields(string(b[i+1:])), nil
}

// clockTick is USER_HZ, the unit of /proc's CPU times: 100 on every Linux ABI Go supports.
const clockTick = 10 * time.Millisecond

// cpuTime is the process's CPU time: the sum of its live threads' run times from schedstat
// (nanoseconds), or utime+stime from stat (clock ticks, and counting exited threads) when
// schedstat is missing.
func cpuTime(pid int) (time.Duration, error) {
	if d, err := schedTime(pid); err == nil {
		return d, nil
	}
	st, err := stat(pid)
	if err != nil {
		return 0, err
	}
	if len(st) < 13 {
		return 0, errors.New("malformed /proc stat")
	}
	// utime and stime are fields 14 and 15; st starts at field 3.
	ut, err1 := strconv.ParseUint(st[11], 10, 64)
	stm, err2 := strconv.ParseUint(st[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+stm) * clockTick, nil
}

func schedTime(pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var total time.Duration
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, task.Name()))
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // the thread exited meanwhile
			}
			return 0, err
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			return 0, errors.New("malformed schedstat")
		}
		ns, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, err
		}
		total += time.Duration(ns) //nolint:gosec // nanoseconds of CPU fit
	}
	return total, nil
}

func alive(pid int) bool {
	st, err := stat(pid)
	return err == nil && len(st) > 0 && st[0] != "Z"
}
