package launch

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// RestartPolicy is how Supervise restarts a service that exited on its own: with an
// exponential backoff, as the kubelet restarts a crashed container, giving up on a crash
// loop. Zero fields take the defaults below.
type RestartPolicy struct {
	// Backoff is the wait before a first restart; each further one doubles it, up to
	// MaxBackoff. Default 1 s.
	Backoff time.Duration
	// MaxBackoff caps the wait. Default 30 s.
	MaxBackoff time.Duration
	// Stable is how long a restarted service must run before its backoff starts again
	// from Backoff. Default 60 s.
	Stable time.Duration
	// MaxRestarts is how many restarts of one service within Window are tolerated; one
	// more is a crash loop, and Supervise gives up. Default 5 in 5 minutes.
	MaxRestarts int
	Window      time.Duration
	// ServeTimeout bounds a restarted service's wait for SERVING. Default 30 s.
	ServeTimeout time.Duration
}

// The RestartPolicy defaults.
const (
	DefaultRestartBackoff    = time.Second
	DefaultRestartMaxBackoff = 30 * time.Second
	DefaultRestartStable     = time.Minute
	DefaultMaxRestarts       = 5
	DefaultRestartWindow     = 5 * time.Minute
	DefaultServeTimeout      = 30 * time.Second
)

func (p RestartPolicy) withDefaults() RestartPolicy {
	if p.Backoff <= 0 {
		p.Backoff = DefaultRestartBackoff
	}
	if p.MaxBackoff <= 0 {
		p.MaxBackoff = DefaultRestartMaxBackoff
	}
	if p.Stable <= 0 {
		p.Stable = DefaultRestartStable
	}
	if p.MaxRestarts <= 0 {
		p.MaxRestarts = DefaultMaxRestarts
	}
	if p.Window <= 0 {
		p.Window = DefaultRestartWindow
	}
	if p.ServeTimeout <= 0 {
		p.ServeTimeout = DefaultServeTimeout
	}
	return p
}

// EventKind says what happened to a supervised service.
type EventKind string

// The events Supervise reports.
const (
	// Exited: the service exited on its own; it is restarted after Event.Backoff.
	Exited EventKind = "exited"
	// Restarted: the service was started again and reports SERVING (Event.PID).
	Restarted EventKind = "restarted"
	// RestartFailed: a restart did not reach SERVING (Event.Err); it is tried again
	// after Event.Backoff, and counts as a restart.
	RestartFailed EventKind = "restart_failed"
	// GaveUp: the service crash-looped (more than MaxRestarts within Window); Supervise
	// returns.
	GaveUp EventKind = "gave_up"
)

// Event is one thing that happened to a supervised service.
type Event struct {
	Kind     EventKind
	Service  string
	Err      error         // how it exited (Exited, GaveUp) or why the restart failed
	Restarts int           // the service's restarts so far, this one included
	Backoff  time.Duration // the wait before the next start (Exited, RestartFailed)
	PID      int           // the new process (Restarted)
}

func (e Event) String() string {
	switch e.Kind {
	case Exited:
		return fmt.Sprintf("%s exited unexpectedly (%v); restarting it in %v (restart %d)", e.Service, e.Err, e.Backoff, e.Restarts)
	case Restarted:
		return fmt.Sprintf("%s restarted (pid %d, restart %d)", e.Service, e.PID, e.Restarts)
	case RestartFailed:
		return fmt.Sprintf("%s did not come back (%v); trying again in %v", e.Service, e.Err, e.Backoff)
	default:
		return fmt.Sprintf("%s is crash-looping (%d restarts; last exit: %v); giving up", e.Service, e.Restarts, e.Err)
	}
}

// Supervise keeps the mesh's services running until ctx is done: a service that exits
// is started again on the same addresses after a backoff, and every step is reported to
// report (called from one goroutine at a time). It returns nil when ctx is done, or the
// error naming the service that crash-looped; the caller then stops the mesh.
// Supervise must not run while Stop does.
func (m *Mesh) Supervise(ctx context.Context, policy RestartPolicy, report func(Event)) error {
	policy = policy.withDefaults()
	if report == nil {
		report = func(Event) {}
	}
	events := make(chan Event)
	gaveUp := make(chan error, len(m.procs))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan struct{})
	for _, p := range m.procs {
		go func() {
			if err := m.supervise(ctx, p, policy, events); err != nil {
				gaveUp <- err
			}
			done <- struct{}{}
		}()
	}
	running := len(m.procs)
	var out error
	for running > 0 {
		select {
		case e := <-events:
			report(e)
		case err := <-gaveUp:
			if out == nil {
				out = err
				cancel() // the caller stops the mesh
			}
		case <-done:
			running--
		}
	}
	return out
}

// supervise restarts p each time it exits, until ctx is done or it crash-loops.
func (m *Mesh) supervise(ctx context.Context, p *Process, policy RestartPolicy, events chan<- Event) error {
	send := func(e Event) bool {
		select {
		case events <- e:
			return true
		case <-ctx.Done():
			return false
		}
	}
	var (
		restarts []time.Time // within policy.Window
		backoff  time.Duration
		started  = time.Now()
		total    int
	)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-p.Done():
		}
		exitErr := p.Err()
		if exitErr == nil {
			exitErr = errors.New("exit status 0")
		}
		failedStart := false // the last restart did not serve (RestartFailed said so)
		for {
			now := time.Now()
			if now.Sub(started) >= policy.Stable {
				backoff = 0 // it ran long enough: a new crash is not part of a loop
			}
			kept := restarts[:0]
			for _, at := range restarts {
				if now.Sub(at) < policy.Window {
					kept = append(kept, at)
				}
			}
			restarts = kept
			if len(restarts) >= policy.MaxRestarts {
				err := fmt.Errorf("%s crash-looped: %d restarts within %v; last exit: %w", p.Name, len(restarts), policy.Window, exitErr)
				send(Event{Kind: GaveUp, Service: p.Name, Err: exitErr, Restarts: total})
				return err
			}
			if backoff == 0 {
				backoff = policy.Backoff
			} else {
				backoff = min(2*backoff, policy.MaxBackoff)
			}
			restarts = append(restarts, now)
			total++
			if !failedStart && !send(Event{Kind: Exited, Service: p.Name, Err: exitErr, Restarts: total, Backoff: backoff}) {
				return nil
			}
			t := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
			started = time.Now()
			err := p.Start()
			if err == nil {
				wctx, stop := context.WithTimeout(ctx, policy.ServeTimeout)
				err = p.waitServing(wctx, policy.ServeTimeout)
				stop()
			}
			if ctx.Err() != nil {
				return nil //nolint:nilerr // the mesh is stopping: a start cut short is no crash
			}
			if err == nil {
				if !send(Event{Kind: Restarted, Service: p.Name, Restarts: total, PID: p.PID()}) {
					return nil
				}
				break
			}
			// Not serving: stop what may still run of it, and count it as a crash.
			_ = p.Stop(m.stopGrace)
			exitErr, failedStart = err, true
			if !send(Event{Kind: RestartFailed, Service: p.Name, Err: err, Restarts: total, Backoff: min(2*backoff, policy.MaxBackoff)}) {
				return nil
			}
		}
	}
}
