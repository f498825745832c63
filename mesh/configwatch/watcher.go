package configwatch

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultInterval is how often a watcher reads its file when Config.Interval is 0.
const DefaultInterval = time.Second

// Config configures a Watcher of configurations of type T.
type Config[T any] struct {
	// Name names the configuration in logs, metrics (the config label) and Status:
	// "admission", "retry", "tools", "decoder".
	Name string
	// Path is the file. It is read whole at every check; a symlink is followed each time.
	Path string
	// Load decodes and validates the file's bytes. It must not change anything: the
	// running configuration changes only in Apply, and only with what Load returned.
	Load func(data []byte) (T, error)
	// Apply swaps a loaded configuration into the running service. An error keeps the
	// running configuration (Apply must then have changed nothing) and counts as a failed
	// reload. nil means the service reads Current instead.
	Apply func(T) error
	// Interval is how often the file is read; 0 means DefaultInterval.
	Interval time.Duration
	// OnReload, when set, is called after each reload that was tried (the content changed,
	// or SIGHUP), success or failure, with the status it left: the seam through which a
	// service records its configuration version in the store. It runs on the watcher's
	// goroutine (or Reload's caller) with the reload lock held: it must not call the
	// watcher's methods, nor block for long.
	OnReload func(Status)
}

// Status is what a watcher reports of its configuration.
type Status struct {
	// Name and Path are the Config's.
	Name, Path string
	// Version is the running configuration's version: the first 12 hex digits of the
	// SHA-256 of the file it was loaded from.
	Version string
	// LoadedAt is when the running configuration was loaded.
	LoadedAt time.Time
	// LastError is why the last reload failed, "" when it succeeded (or none was tried
	// since start).
	LastError string
	// LastErrorAt is when the last reload failed; zero when LastError is "".
	LastErrorAt time.Time
}

// Metrics are the reload metrics of one service's watchers.
type Metrics struct {
	service  string
	failures *prometheus.CounterVec
	reloads  *prometheus.CounterVec
}

// NewMetrics creates the reload metrics of service and registers them with reg (when
// not nil). Each watcher made with them exports its series at zero from its start.
func NewMetrics(service string, reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		service: service,
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_config_reload_failures_total",
			Help: "Reloads of a configuration file that failed (unreadable, undecodable, invalid, or refused by the running service); the running configuration was kept.",
		}, []string{"service", "config"}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_config_reloads_total",
			Help: "Reloads of a configuration file that changed the running configuration.",
		}, []string{"service", "config"}),
	}
	if reg != nil {
		reg.MustRegister(m.failures, m.reloads)
	}
	return m
}

// Watcher keeps one configuration file live. Create it with New, then Start it; Close
// stops it. Its methods are safe for concurrent use.
type Watcher[T any] struct {
	cfg      Config[T]
	log      *slog.Logger
	failures prometheus.Counter
	reloads  prometheus.Counter

	mu     sync.Mutex // serializes reloads and guards what follows
	cur    T
	status Status
	seen   string // digest of the content (or read error) last tried

	stopOnce sync.Once
	cancel   context.CancelFunc
	done     chan struct{}
}

// New loads the file once and returns its watcher, not yet started. A file that does not
// load is an error: at start there is no running configuration to keep. m may be nil (no
// metrics), log nil (slog.Default).
func New[T any](cfg Config[T], m *Metrics, log *slog.Logger) (*Watcher[T], error) {
	if cfg.Name == "" || cfg.Path == "" || cfg.Load == nil {
		return nil, errors.New("configwatch: Name, Path and Load are required")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if log == nil {
		log = slog.Default()
	}
	w := &Watcher[T]{cfg: cfg, log: log.With("config", cfg.Name, "path", cfg.Path)}
	if m != nil {
		w.failures = m.failures.WithLabelValues(m.service, cfg.Name)
		w.reloads = m.reloads.WithLabelValues(m.service, cfg.Name)
	}
	data, err := os.ReadFile(cfg.Path) //nolint:gosec // the operator names the file
	if err != nil {
		return nil, err
	}
	v, err := cfg.Load(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cfg.Path, err)
	}
	d := digest(data)
	w.cur, w.seen = v, d
	w.status = Status{Name: cfg.Name, Path: cfg.Path, Version: d, LoadedAt: time.Now()}
	return w, nil
}

// Current is the running configuration.
func (w *Watcher[T]) Current() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cur
}

// Status reports the running configuration's version and the last reload's failure.
func (w *Watcher[T]) Status() Status {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.status
}

// Start begins watching: the file every Config.Interval, and SIGHUP. SIGHUP is
// subscribed before Start returns, so a signal sent afterwards reloads rather than
// ending the process. The watcher stops when ctx ends or on Close.
func (w *Watcher[T]) Start(ctx context.Context) {
	ctx, w.cancel = context.WithCancel(ctx) //nolint:gosec // G118: Close calls w.cancel
	w.done = make(chan struct{})
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		defer close(w.done)
		defer signal.Stop(hup)
		t := time.NewTicker(w.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				_ = w.check(false) // logged, counted and kept in Status
			case <-hup:
				w.log.Info("SIGHUP: reloading the configuration file")
				_ = w.check(true) // logged, counted and kept in Status
			}
		}
	}()
}

// Close stops a started watcher and waits for its goroutine. It is idempotent, and a
// no-op on a watcher never started.
func (w *Watcher[T]) Close() {
	w.stopOnce.Do(func() {
		if w.cancel != nil {
			w.cancel()
			<-w.done
		}
	})
}

// Reload reads the file now and applies it when it loads, whether or not its content
// changed (what SIGHUP does). It returns the reload's error, which is also logged,
// counted and kept in Status.
func (w *Watcher[T]) Reload() error { return w.check(true) }

// check reloads the file when its content differs from the content last tried, or
// always when force is set.
func (w *Watcher[T]) check(force bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	data, err := os.ReadFile(w.cfg.Path) //nolint:gosec // the operator names the file
	d := ""
	if err != nil {
		d = "read error: " + err.Error() // one report per distinct failure, not per tick
	} else {
		d = digest(data)
	}
	if !force && d == w.seen {
		return nil
	}
	w.seen = d
	if err == nil {
		var v T
		if v, err = w.cfg.Load(data); err == nil && w.cfg.Apply != nil {
			err = w.cfg.Apply(v)
		}
		if err == nil {
			old := w.status.Version
			w.cur = v
			w.status.Version, w.status.LoadedAt = d, time.Now()
			w.status.LastError, w.status.LastErrorAt = "", time.Time{}
			if w.reloads != nil {
				w.reloads.Inc()
			}
			w.log.Info("configuration reloaded", "version", d, "previous_version", old)
		}
	}
	if err != nil {
		w.status.LastError, w.status.LastErrorAt = err.Error(), time.Now()
		if w.failures != nil {
			w.failures.Inc()
		}
		w.log.Error("configuration reload failed; the running configuration is kept",
			"error", err.Error(), "version", w.status.Version)
	}
	if w.cfg.OnReload != nil {
		w.cfg.OnReload(w.status)
	}
	return err
}

// digest is a content's version: 12 hex digits of its SHA-256.
func digest(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:6])
}

// Failures is the failure counter of the configuration name, for tests and callers that
// report it.
func (m *Metrics) Failures(name string) prometheus.Counter {
	return m.failures.WithLabelValues(m.service, name)
}
