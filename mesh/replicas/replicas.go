package replicas

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
)

// DefaultRefresh is how long a resolution of a dns:/// target is used before Conns
// resolves the name again.
const DefaultRefresh = time.Second

// Set is the replicas of one mesh service behind a gRPC target. With a dns:/// target
// (dns:///curfew-toolrunner:7702, a headless Service) it is every address the name
// resolves to, each with a connection of its own; with any other target (an address,
// 127.0.0.1:7702) it is that target alone. The zero value is not usable; make one with
// New. A Set is safe for concurrent use.
type Set struct {
	target     string
	host, port string // of a dns:/// target; host == "" otherwise
	dial       func(addr string) (*grpc.ClientConn, error)
	lookup     func(ctx context.Context, host string) ([]string, error)
	refresh    time.Duration
	log        *slog.Logger
	// customLookup: WithLookup was given, and wins over a target's DNS server.
	customLookup bool

	mu       sync.Mutex
	conns    map[string]*grpc.ClientConn // by address
	addrs    []string                    // of the last good resolution, sorted
	resolved time.Time
	// resolving is closed when the resolution under way ends; nil when none is.
	resolving chan struct{}
	closed    bool

	// bg counts the resolutions under way; bgCtx is theirs, cancelled by Close.
	bg       sync.WaitGroup
	bgCtx    context.Context
	bgCancel context.CancelFunc
}

// Option configures a Set.
type Option func(*Set)

// WithLookup sets how host names are resolved to addresses: net.DefaultResolver's
// LookupHost when not set. Tests resolve a name to loopback addresses with it.
func WithLookup(f func(ctx context.Context, host string) ([]string, error)) Option {
	return func(s *Set) { s.lookup, s.customLookup = f, true }
}

// WithRefresh sets how long a resolution is used: DefaultRefresh when not set or not
// positive.
func WithRefresh(d time.Duration) Option {
	return func(s *Set) {
		if d > 0 {
			s.refresh = d
		}
	}
}

// WithLogger sets where failed resolutions are logged: slog.Default when not set.
func WithLogger(l *slog.Logger) Option {
	return func(s *Set) {
		if l != nil {
			s.log = l
		}
	}
}

// New returns the Set of target. dial makes the connection to one address (or, for a
// target that is not dns:///, to the target itself); connections are made when first
// needed, and closed by Close or when their address no longer resolves.
func New(target string, dial func(addr string) (*grpc.ClientConn, error), opts ...Option) (*Set, error) {
	if target == "" {
		return nil, errors.New("replicas: empty target")
	}
	s := &Set{target: target, dial: dial, lookup: net.DefaultResolver.LookupHost, refresh: DefaultRefresh,
		log: slog.Default(), conns: map[string]*grpc.ClientConn{}}
	for _, o := range opts {
		o(s)
	}
	if rest, ok := strings.CutPrefix(target, "dns:"); ok {
		// dns:///host:port (the system resolver), or dns://server:port/host:port (that DNS
		// server, as gRPC's own dns resolver does).
		authority := ""
		if r, ok := strings.CutPrefix(rest, "//"); ok {
			i := strings.IndexByte(r, '/')
			if i < 0 {
				return nil, fmt.Errorf("replicas: %s: want dns:///host:port or dns://server:port/host:port", target)
			}
			authority, rest = r[:i], r[i+1:]
		}
		host, port, err := net.SplitHostPort(rest)
		if err != nil || host == "" || port == "" {
			return nil, fmt.Errorf("replicas: %s: want dns:///host:port or dns://server:port/host:port", target)
		}
		s.host, s.port = host, port
		if authority != "" && !s.customLookup {
			if _, _, err := net.SplitHostPort(authority); err != nil {
				return nil, fmt.Errorf("replicas: %s: the DNS server %q is not host:port", target, authority)
			}
			r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, network, authority)
			}}
			s.lookup = r.LookupHost
		}
	}
	s.bgCtx, s.bgCancel = context.WithCancel(context.Background())
	return s, nil
}

// LookupTimeout bounds one resolution of a dns:/// target.
const LookupTimeout = time.Second

// Conns returns a connection to every replica: each address the name resolved to at
// most the refresh period ago (a failed resolution keeps the last good one, and with none
// falls back to the target itself, one replica of gRPC's choosing), or the target's one
// connection. An address it cannot dial is left out and logged.
//
// Once the name has an answer, no caller waits for DNS: the first caller to find the
// answer older than the refresh period starts one resolution in the background (bounded
// by LookupTimeout), and every caller, that one included, uses the last addresses
// meanwhile. A cancel broadcast must not wait out a lookup of the DNS server. Only before
// the first answer do callers wait for it (or for ctx).
func (s *Set) Conns(ctx context.Context) []*grpc.ClientConn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	if s.host != "" && time.Since(s.resolved) >= s.refresh {
		if s.resolving == nil {
			s.resolving = make(chan struct{})
			s.bg.Add(1)
			go s.resolve(s.resolving) //nolint:contextcheck // outlives the call that started it, on the Set's own context (Close cancels it)
		}
		if s.resolved.IsZero() { // the first resolution is under way: wait for it
			done := s.resolving
			s.mu.Unlock()
			select {
			case <-done:
			case <-ctx.Done():
			}
			s.mu.Lock()
			if s.closed {
				return nil
			}
		}
	}
	addrs := []string{s.target}
	if len(s.addrs) > 0 {
		addrs = s.addrs
	}
	out := make([]*grpc.ClientConn, 0, len(addrs))
	for _, a := range addrs {
		c := s.conns[a]
		if c == nil {
			var err error
			if c, err = s.dial(a); err != nil {
				s.log.WarnContext(ctx, "replicas: cannot dial a replica", "target", s.target, "addr", a, "error", err.Error())
				continue
			}
			s.conns[a] = c
		}
		out = append(out, c)
	}
	return out
}

// resolve looks the name up once, for at most LookupTimeout, applies the answer, and
// closes done.
func (s *Set) resolve(done chan struct{}) {
	defer s.bg.Done()
	ctx, cancel := context.WithTimeout(s.bgCtx, LookupTimeout)
	ips, err := s.lookup(ctx, s.host)
	cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resolving = nil
	close(done)
	if s.closed {
		return
	}
	s.apply(s.bgCtx, ips, err)
}

// apply takes a resolution's answer: on success the addresses are replaced and the
// connections of those gone closed; a failure keeps the last addresses. Called with
// s.mu held.
func (s *Set) apply(ctx context.Context, ips []string, err error) {
	s.resolved = time.Now()
	if err != nil || len(ips) == 0 {
		if err == nil {
			err = errors.New("no addresses")
		}
		s.log.WarnContext(ctx, "replicas: cannot resolve; keeping the last addresses", "target", s.target, "error", err.Error(), "addrs", len(s.addrs))
		return
	}
	addrs := make([]string, 0, len(ips))
	for _, ip := range ips {
		addrs = append(addrs, net.JoinHostPort(ip, s.port))
	}
	slices.Sort(addrs)
	addrs = slices.Compact(addrs)
	for a, c := range s.conns {
		if !slices.Contains(addrs, a) {
			_ = c.Close()
			delete(s.conns, a)
		}
	}
	s.addrs = addrs
}

// Close closes every connection, and stops and waits for a resolution under way; Conns
// returns none afterwards.
func (s *Set) Close() error {
	s.mu.Lock()
	s.closed = true
	s.bgCancel()
	var errs []error
	for a, c := range s.conns {
		errs = append(errs, c.Close())
		delete(s.conns, a)
	}
	s.mu.Unlock()
	s.bg.Wait()
	return errors.Join(errs...)
}
