package meshtls

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// Option configures a Source.
type Option func(*options)

type options struct {
	interval time.Duration
	log      *slog.Logger
}

// WithReloadInterval sets how often, at most, a Source looks at its files for changes:
// DefaultReloadInterval when not set or not positive.
func WithReloadInterval(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.interval = d
		}
	}
}

// WithLogger sets where a Source logs its reloads (info) and failed reloads (warn):
// slog.Default when not set or nil.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.log = l
		}
	}
}

// Source serves a mesh identity's current certificate, key and trusted CAs from the
// files in its directory (<identity>.crt, <identity>.key and ca.crt), and picks up
// changed files without a restart.
//
// It runs no goroutine. A handshake looks at the files' size, modification time and
// inode when the reload interval has passed since the last look, and reads them when one
// changed: a change is seen by every handshake that begins more than one interval after
// it. A file that does not parse, a key that does not match its certificate (a
// rotation half written), or a certificate of another identity is not taken: the Source
// keeps the last good certificate and key (and, independently, the last good CAs), logs
// a warning, counts an error in Stats, and tries again at the next interval.
// Connections already established keep the certificates of their handshake.
//
// A Source is safe for concurrent use.
type Source struct {
	identity                  string
	caPath, certPath, keyPath string
	interval                  time.Duration
	log                       *slog.Logger

	next atomic.Int64             // time.Time.UnixNano of the next look at the files
	cur  atomic.Pointer[snapshot] // never nil after NewSource

	mu                  sync.Mutex // serializes looks at the files; guards the fields below
	caSig, crtSig, kSig fileSig    // of the files last taken
	caRaw, crtRaw, kRaw []byte     // contents last taken
	lastFail            string     // the failure last reported, not reported again
	stats               Stats
}

// snapshot is one consistent state of a Source. A new one is made at each change, so
// that its pointer tells states apart.
type snapshot struct {
	pair *tls.Certificate
	pool *x509.CertPool
}

// Stats counts a Source's reloads.
type Stats struct {
	// Reloads counts the changes taken (a certificate, key or ca.crt), the first load
	// included.
	Reloads uint64
	// Errors counts failed reloads: each distinct bad state of the files once, however
	// long it lasts.
	Errors uint64
	// LastError is the error of the last look at the files, nil when it succeeded.
	LastError error
}

// NewSource loads identity's certificate and key and the trusted CAs from dir
// (<identity>.crt, <identity>.key and ca.crt, as written by CA.Issue and EnsureCA). It
// fails if they cannot be loaded, the key does not match the certificate, or the
// certificate's URI SAN is not identity's.
func NewSource(dir, identity string, opts ...Option) (*Source, error) {
	if err := checkIdentity(identity); err != nil {
		return nil, err
	}
	o := options{interval: DefaultReloadInterval, log: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	s := &Source{
		identity: identity,
		caPath:   filepath.Join(dir, CACertFile),
		certPath: filepath.Join(dir, identity+".crt"),
		keyPath:  filepath.Join(dir, identity+".key"),
		interval: o.interval,
		log:      o.log,
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.load(time.Now()); err != nil {
		return nil, err
	}
	return s, nil
}

// Identity returns the Source's mesh identity.
func (s *Source) Identity() string { return s.identity }

// Certificate returns the current certificate (the leaf), looking at the files first if
// the reload interval has passed.
func (s *Source) Certificate() *x509.Certificate { return s.current().pair.Leaf }

// Reload looks at the files now, whatever the interval, and takes what changed. It
// returns the error of a file it could not take (the previous contents stay in use).
func (s *Source) Reload() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.load(time.Now())
}

// Stats returns the Source's counts.
func (s *Source) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// current returns the current state, looking at the files first if the reload interval
// has passed since the last look.
func (s *Source) current() *snapshot {
	if time.Now().UnixNano() >= s.next.Load() {
		s.mu.Lock()
		// Another handshake may have looked while this one waited.
		if now := time.Now(); now.UnixNano() >= s.next.Load() {
			_ = s.load(now) // reported by load; the last good state stays
		}
		s.mu.Unlock()
	}
	return s.cur.Load()
}

// load looks at the files and takes those that changed and are good. Called with s.mu
// held.
func (s *Source) load(now time.Time) error {
	s.next.Store(now.Add(s.interval).UnixNano())
	old := s.cur.Load()
	next := snapshot{}
	if old != nil {
		next = *old
	}
	// Stat before reading: a change after the stat is seen at the next look.
	caSig, crtSig, kSig := statFile(s.caPath), statFile(s.certPath), statFile(s.keyPath)
	var errs []error
	changed := false

	if old == nil || caSig != s.caSig {
		if raw, pool, err := readPool(s.caPath); err != nil {
			errs = append(errs, err)
		} else {
			if old == nil || !bytes.Equal(raw, s.caRaw) { // not a touch
				next.pool, s.caRaw, changed = pool, raw, true
			}
			s.caSig = caSig
		}
	}
	if old == nil || crtSig != s.crtSig || kSig != s.kSig {
		if crt, key, pair, err := s.readPair(); err != nil {
			errs = append(errs, err)
		} else {
			if old == nil || !bytes.Equal(crt, s.crtRaw) || !bytes.Equal(key, s.kRaw) {
				next.pair, s.crtRaw, s.kRaw, changed = pair, crt, key, true
			}
			s.crtSig, s.kSig = crtSig, kSig
		}
	}
	if old == nil && len(errs) > 0 {
		return errors.Join(errs...)
	}

	if changed {
		s.cur.Store(&next)
		s.stats.Reloads++
		leaf := next.pair.Leaf
		s.log.Info("meshtls: certificates loaded", "identity", s.identity, "serial", fmt.Sprintf("%x", leaf.SerialNumber),
			"not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
		if now.After(leaf.NotAfter) || now.Before(leaf.NotBefore) {
			s.log.Warn("meshtls: certificate is not valid now", "identity", s.identity, "path", s.certPath,
				"not_before", leaf.NotBefore.UTC().Format(time.RFC3339), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	err := errors.Join(errs...)
	s.stats.LastError = err
	if err == nil {
		s.lastFail = ""
		return nil
	}
	// A bad state is retried at every interval (a file may be rewritten in place within
	// one modification-time tick) but reported once.
	if fail := fmt.Sprint(err, caSig, crtSig, kSig); fail != s.lastFail {
		s.lastFail = fail
		s.stats.Errors++
		s.log.Warn("meshtls: certificate reload failed; keeping the previous ones", "identity", s.identity, "error", err.Error())
	}
	return err
}

// readPair reads and checks the certificate and key files.
func (s *Source) readPair() (crt, key []byte, pair *tls.Certificate, err error) {
	if crt, err = os.ReadFile(s.certPath); err != nil {
		return nil, nil, nil, fmt.Errorf("meshtls: %w", err)
	}
	if key, err = os.ReadFile(s.keyPath); err != nil {
		return nil, nil, nil, fmt.Errorf("meshtls: %w", err)
	}
	c, err := tls.X509KeyPair(crt, key)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("meshtls: %s and %s: %w", s.certPath, s.keyPath, err)
	}
	if c.Leaf == nil {
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			return nil, nil, nil, fmt.Errorf("meshtls: %s: %w", s.certPath, err)
		}
	}
	if id, ok := identityOf(c.Leaf); !ok || id != s.identity {
		return nil, nil, nil, fmt.Errorf("meshtls: %s: certificate is not for %s", s.certPath, idURI(s.identity))
	}
	return crt, key, &c, nil
}

// readPool reads and parses a ca.crt.
func readPool(path string) ([]byte, *x509.CertPool, error) {
	raw, err := os.ReadFile(path) //nolint:gosec // a file of --tls-dir, which the operator names
	if err != nil {
		return nil, nil, fmt.Errorf("meshtls: %w", err)
	}
	cas, err := parseCAs(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("meshtls: %s: %w", path, err)
	}
	pool := x509.NewCertPool()
	for _, c := range cas {
		pool.AddCert(c)
	}
	return raw, pool, nil
}

// fileSig is what a look at a file compares: a file replaced by a rename has a new
// inode, one rewritten in place a new modification time or size.
type fileSig struct {
	ino  uint64
	mod  int64
	size int64
	err  string
}

func statFile(path string) fileSig {
	fi, err := os.Stat(path)
	if err != nil {
		return fileSig{err: err.Error()}
	}
	return fileSig{ino: inode(fi), mod: fi.ModTime().UnixNano(), size: fi.Size()}
}
