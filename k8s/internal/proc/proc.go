package proc

import (
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
	"strings"
	"syscall"
	"time"
)

// GracePeriod is how long a process has to exit after SIGTERM before it is killed.
const GracePeriod = 20 * time.Second

// TailLines is how much of a log Tail and the readiness errors quote.
const TailLines = 40

// Process is one child process with its output in a log file.
type Process struct {
	name   string
	cmd    *exec.Cmd
	log    *os.File
	cancel context.CancelFunc
	done   chan struct{} // closed when the process has exited, with err
	err    error
}

// Options adjusts Start; the zero value runs the binary with the test's environment.
type Options struct {
	// Env, when not nil, is the process's whole environment.
	Env []string
	// Dir is the working directory; empty means the test's.
	Dir string
}

// Start starts bin with args, its stdout and stderr going to logPath. The process outlives
// ctx, which bounds the start only: Stop ends it.
func Start(ctx context.Context, bin, logPath string, args ...string) (*Process, error) {
	return StartWith(ctx, Options{}, bin, logPath, args...)
}

// StartWith is Start with Options.
func StartWith(ctx context.Context, opts Options, bin, logPath string, args ...string) (*Process, error) {
	log, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("proc: %w", err)
	}
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	cmd := exec.CommandContext(pctx, bin, args...)
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.Env = opts.Env
	cmd.Dir = opts.Dir
	cmd.SysProcAttr = sysProcAttr()
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = GracePeriod
	p := &Process{name: filepath.Base(bin), cmd: cmd, log: log, cancel: cancel, done: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		cancel()
		log.Close()
		return nil, fmt.Errorf("proc: start %s: %w", bin, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Name is the base name of the binary.
func (p *Process) Name() string { return p.name }

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited tells whether the process has exited, and with what.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// WaitReady polls ready every 250ms until it succeeds, the process exits, ctx ends or
// timeout passes; the errors name the last failure and end with the process's log.
func (p *Process) WaitReady(ctx context.Context, timeout time.Duration, ready func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if last = ready(ctx); last == nil {
			return nil
		}
		select {
		case <-p.done:
			exit := p.err
			if exit == nil {
				exit = errors.New("exit status 0")
			}
			return fmt.Errorf("%s exited before it was ready (%w); its log:\n%s", p.name, exit, p.Tail())
		case <-ctx.Done():
			return fmt.Errorf("%s not ready after %s (last: %w); its log:\n%s", p.name, timeout, last, p.Tail())
		case <-tick.C:
		}
	}
}

// Stop ends the process (SIGTERM, then SIGKILL after GracePeriod) and waits for it. A nil
// Process is a no-op, so that a half-started set can be stopped whole.
func (p *Process) Stop() {
	if p == nil {
		return
	}
	p.cancel()
	<-p.done
	p.log.Close()
}

// LostPort tells whether the process exited because its port had been taken meanwhile.
func (p *Process) LostPort() bool {
	if exited, _ := p.Exited(); !exited {
		return false
	}
	data, err := os.ReadFile(p.log.Name())
	return err == nil && bytes.Contains(data, []byte("address already in use"))
}

// Tail returns the last TailLines lines of the process's log.
func (p *Process) Tail() string {
	if p == nil {
		return "(not started)"
	}
	data, err := os.ReadFile(p.log.Name())
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > TailLines {
		lines = lines[len(lines)-TailLines:]
	}
	return strings.Join(lines, "\n")
}

// FreePorts returns n distinct loopback ports that were free a moment ago.
func FreePorts(ctx context.Context, n int) ([]int, error) {
	var lc net.ListenConfig
	ports := make([]int, 0, n)
	for range n {
		l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("proc: a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// GetOK GETs url, with token as a bearer token when not empty, and wants 200.
func GetOK(ctx context.Context, c *http.Client, url, token string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, http.NoBody)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
