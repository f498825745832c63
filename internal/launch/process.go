package launch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// Process is one service process. It can be started again once it has exited, with the
// same addresses, as a restarted pod keeps its Service's name.
type Process struct {
	Name      string   // the service's name in errors, "orchestrator-a" say
	Bin       string   // the binary
	Args      []string // its flags, addresses included
	Addr      string   // its gRPC address, which WaitServing asks
	AdminAddr string   // its admin address, for the caller's reference
	// OpenAIAddr is the orchestrator's OpenAI-compatible API, for the caller's reference.
	OpenAIAddr string
	// ConsoleAddr is the orchestrator's web console, for the caller's reference.
	ConsoleAddr string
	Log         string // the file its stdout and stderr are appended to
	// Creds are what WaitServing presents to the service; nil is plaintext.
	Creds credentials.TransportCredentials
	// ParentDeathSignal is sent to the process when its parent dies; SIGTERM when 0,
	// so that it shuts down gracefully even if its launcher is killed.
	ParentDeathSignal syscall.Signal

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited; err is then set
	err  error
}

// Start starts the process and returns without waiting for it to serve (WaitServing
// does). It runs in a process group of its own, so that a terminal's Ctrl-C reaches only
// its launcher, which stops it in order.
func (p *Process) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && !closed(p.done) {
		return fmt.Errorf("start %s: already running", p.Name)
	}
	logf, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644) //nolint:gosec // the user's own logs, which hold no secrets
	if err != nil {
		return err
	}
	// Not CommandContext: a context would SIGKILL the service; Stop ends it with SIGTERM
	// and a grace instead.
	cmd := exec.Command(p.Bin, p.Args...) //nolint:noctx,gosec // see above; a service binary from --bin-dir or next to curfew
	cmd.Stdout, cmd.Stderr = logf, logf
	sig := p.ParentDeathSignal
	if sig == 0 {
		sig = syscall.SIGTERM
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: sig}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		_ = logf.Close()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(done)
	}()
	p.cmd, p.done, p.err = cmd, done, nil
	return nil
}

func closed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// PID is the process id of the last start; 0 before the first.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Running reports whether the process has started and not exited.
func (p *Process) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && !closed(p.done)
}

// Done is closed when the last start's process has exited; nil before the first start.
func (p *Process) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// Err is how the process exited (cmd.Wait's error) once Done is closed.
func (p *Process) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Stop ends the process with SIGTERM (a graceful shutdown) and waits up to grace, then
// kills it; it reports the kill. A process not running is left alone.
func (p *Process) Stop(grace time.Duration) error { return p.signal(syscall.SIGTERM, grace) }

// Kill ends the process with SIGKILL, as a crash or an OOM kill would, and waits.
func (p *Process) Kill() error { return p.signal(syscall.SIGKILL, 10*time.Second) }

func (p *Process) signal(sig syscall.Signal, wait time.Duration) error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil || closed(done) {
		return nil
	}
	_ = cmd.Process.Signal(sig)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-done: // a stopped process's exit status says nothing more
		return nil
	case <-t.C:
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("%s did not exit within %v of %v", p.Name, wait, sig)
	}
}

// WaitServing waits until the gRPC health of every process, in turn, reports SERVING,
// all within timeout. It fails early when a process exits.
func WaitServing(ctx context.Context, timeout time.Duration, procs ...*Process) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, p := range procs {
		if err := p.waitServing(ctx, timeout); err != nil {
			return err
		}
	}
	return nil
}

// pollEvery is how often waitServing asks.
const pollEvery = 20 * time.Millisecond

func (p *Process) waitServing(ctx context.Context, timeout time.Duration) error {
	creds := p.Creds
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return err
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	done := p.Done()
	for {
		cctx, stop := context.WithTimeout(ctx, time.Second)
		resp, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
		stop()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-done:
			err := p.Err()
			if err == nil {
				err = errors.New("exit status 0")
			}
			return fmt.Errorf("%s exited during start-up: %w", p.Name, err)
		case <-ctx.Done():
			return errors.Join(fmt.Errorf("%s did not report SERVING within %v", p.Name, timeout), err)
		case <-time.After(pollEvery):
		}
	}
}
