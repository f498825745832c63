package apikey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base32"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Prefix starts every key, so that secret scanners and people can recognise one.
const Prefix = "cfk_"

// Header is the metadata a key is sent in, as "Bearer <key>".
const Header = "authorization"

const (
	idLen     = 16 // base32 characters: 80 bits
	secretLen = 43 // base64url characters without padding: 256 bits
)

var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// Key is a new API key: the full key, shown once, and what the store keeps of it.
type Key struct {
	Secret string       // the whole key, cfk_<id>_<secret>; never stored or logged
	Record store.APIKey // id, tenant and hash, for store.APIKeys.CreateAPIKey
}

// New makes a key for tenant.
func New(tenant string) (Key, error) {
	if tenant == "" {
		return Key{}, errors.New("apikey: a key needs a tenant")
	}
	idb := make([]byte, 10)
	sec := make([]byte, 32)
	if _, err := rand.Read(idb); err != nil {
		return Key{}, err
	}
	if _, err := rand.Read(sec); err != nil {
		return Key{}, err
	}
	id := idEncoding.EncodeToString(idb)
	secret := base64.RawURLEncoding.EncodeToString(sec)
	return Key{Secret: Prefix + id + "_" + secret, Record: store.APIKey{ID: id, Tenant: tenant, Hash: hash(secret)}}, nil
}

// ErrMalformed is Parse's error for anything that is not a curfew API key.
var ErrMalformed = errors.New("apikey: not a curfew API key")

// Parse splits a key into its id and secret.
func Parse(key string) (id, secret string, err error) {
	rest, ok := strings.CutPrefix(key, Prefix)
	if !ok || len(rest) != idLen+1+secretLen || rest[idLen] != '_' {
		return "", "", ErrMalformed
	}
	id, secret = rest[:idLen], rest[idLen+1:]
	if _, err := idEncoding.DecodeString(id); err != nil {
		return "", "", ErrMalformed
	}
	if _, err := base64.RawURLEncoding.DecodeString(secret); err != nil {
		return "", "", ErrMalformed
	}
	return id, secret, nil
}

// ID returns the public id of a key, or "" when it is malformed: what may be logged.
func ID(key string) string {
	id, _, err := Parse(key)
	if err != nil {
		return ""
	}
	return id
}

func hash(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

// Authenticator checks bearer API keys against the store, on every call.
//
// While the store cannot be asked (store.ErrUnavailable: PostgreSQL restarting, out of
// reach), a key is checked against its last record this Authenticator read and verified,
// if that is at most StaleIfUnavailable old: callers keep working through a store
// outage (a cancel above all: a run's stop signal must not depend on the store), and a
// run started meanwhile waits for the store within its deadline. The price: a key revoked
// within that time before the outage, and not presented since, is still taken during
// it. A key refused (unknown, revoked, wrong secret) forgets its record at once.
type Authenticator struct {
	Keys store.APIKeys
	Log  *slog.Logger // nil: slog.Default()
	// StaleIfUnavailable is how old a key's last verified record may be to be used while
	// the store is unavailable; DefaultStaleIfUnavailable when 0, never when negative.
	StaleIfUnavailable time.Duration

	mu   sync.Mutex
	last map[string]verified // by key id
}

// DefaultStaleIfUnavailable is Authenticator.StaleIfUnavailable's default.
const DefaultStaleIfUnavailable = time.Minute

// verified is a key's record as last read from the store and verified, and when.
type verified struct {
	rec store.APIKey
	at  time.Time
}

// maxRemembered bounds the records kept for StaleIfUnavailable; beyond, those too old to
// be used are dropped. Only keys found in the store are kept, so a caller sending made-up
// ids adds nothing.
const maxRemembered = 4096

// errUnauthenticated is every refused key's status, alike on purpose.
var errUnauthenticated = status.Error(codes.Unauthenticated, "invalid API key")

// Tenant returns the tenant of the call's bearer key (metadata authorization: Bearer
// cfk_…). A call without one, or with a key that is malformed, unknown, revoked or
// wrong, is UNAUTHENTICATED; a store failure is UNAVAILABLE.
func (a *Authenticator) Tenant(ctx context.Context) (string, error) {
	k, err := a.Key(ctx)
	return k.Tenant, err
}

// Key returns the record of the call's bearer key (its tenant and scopes), with
// Tenant's errors.
func (a *Authenticator) Key(ctx context.Context) (store.APIKey, error) {
	vals := metadata.ValueFromIncomingContext(ctx, Header)
	if len(vals) == 0 {
		return store.APIKey{}, status.Error(codes.Unauthenticated, "missing API key: send metadata authorization: Bearer <key> (curfew tenant create makes one)")
	}
	if len(vals) > 1 {
		return store.APIKey{}, status.Error(codes.Unauthenticated, "more than one authorization header")
	}
	scheme, key, ok := strings.Cut(vals[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return store.APIKey{}, status.Error(codes.Unauthenticated, "authorization must be: Bearer <key>")
	}
	return a.key(ctx, strings.TrimSpace(key))
}

// KeyTenant returns the tenant of key (cfk_…), with Tenant's errors: for a caller that
// holds the key itself rather than in incoming metadata (the orchestrator's OpenAI front
// door, which needs the tenant before it calls the orchestrator).
func (a *Authenticator) KeyTenant(ctx context.Context, key string) (string, error) {
	k, err := a.key(ctx, key)
	return k.Tenant, err
}

// Lookup returns the record of key (cfk_…), with Tenant's errors: for a caller that
// holds the key itself and needs its scopes too (the web console's sessions).
func (a *Authenticator) Lookup(ctx context.Context, key string) (store.APIKey, error) {
	return a.key(ctx, key)
}

func (a *Authenticator) key(ctx context.Context, key string) (store.APIKey, error) {
	id, secret, err := Parse(key)
	if err != nil {
		a.log().DebugContext(ctx, "API key refused", "reason", "malformed")
		return store.APIKey{}, errUnauthenticated
	}
	rec, err := a.Keys.GetAPIKey(ctx, id)
	stale := false
	switch {
	case errors.Is(err, store.ErrNotFound):
		a.forget(id)
		a.log().DebugContext(ctx, "API key refused", "key_id", id, "reason", "unknown")
		return store.APIKey{}, errUnauthenticated
	case errors.Is(err, store.ErrUnavailable):
		var ok bool
		if rec, ok = a.recent(id); !ok {
			a.log().WarnContext(ctx, "API key lookup failed", "key_id", id, "error", err.Error())
			return store.APIKey{}, status.Error(codes.Unavailable, "cannot check the API key now; retry")
		}
		stale = true
		a.log().DebugContext(ctx, "API key checked against its last record: the store is unavailable", "key_id", id)
	case err != nil:
		a.log().WarnContext(ctx, "API key lookup failed", "key_id", id, "error", err.Error())
		return store.APIKey{}, status.Error(codes.Unavailable, "cannot check the API key now; retry")
	}
	if subtle.ConstantTimeCompare(rec.Hash, hash(secret)) != 1 {
		a.log().DebugContext(ctx, "API key refused", "key_id", id, "reason", "wrong secret")
		return store.APIKey{}, errUnauthenticated // (its record stays: the key itself is sound)
	}
	if rec.Revoked() {
		a.forget(id)
		a.log().DebugContext(ctx, "API key refused", "key_id", id, "reason", "revoked", "revoked_at", rec.RevokedAt)
		return store.APIKey{}, errUnauthenticated
	}
	if !stale {
		a.remember(id, rec)
	}
	return rec, nil
}

// staleWindow is StaleIfUnavailable with its default.
func (a *Authenticator) staleWindow() time.Duration {
	if a.StaleIfUnavailable == 0 {
		return DefaultStaleIfUnavailable
	}
	return a.StaleIfUnavailable
}

// remember keeps rec, just read and verified, for StaleIfUnavailable.
func (a *Authenticator) remember(id string, rec store.APIKey) {
	w := a.staleWindow()
	if w < 0 {
		return
	}
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.last == nil {
		a.last = map[string]verified{}
	}
	if _, ok := a.last[id]; !ok && len(a.last) >= maxRemembered {
		for k, v := range a.last {
			if now.Sub(v.at) > w {
				delete(a.last, k)
			}
		}
	}
	a.last[id] = verified{rec: rec, at: now}
}

// recent returns id's last verified record if it is young enough to be used.
func (a *Authenticator) recent(id string) (store.APIKey, bool) {
	w := a.staleWindow()
	a.mu.Lock()
	defer a.mu.Unlock()
	v, ok := a.last[id]
	if !ok || w < 0 || time.Since(v.at) > w {
		return store.APIKey{}, false
	}
	return v.rec, true
}

// forget drops id's record: the store refused the key.
func (a *Authenticator) forget(id string) {
	a.mu.Lock()
	delete(a.last, id)
	a.mu.Unlock()
}

// Caller names the caller of a server call's ctx, for the audit log and a run's
// starter: "key:<id>" for a call with a bearer API key, "mesh:<identity>" for a mesh
// peer without one, "" for neither. It does not authenticate: ask it once the server
// chain has.
func Caller(ctx context.Context) string {
	if vals := metadata.ValueFromIncomingContext(ctx, Header); len(vals) == 1 {
		if _, key, ok := strings.Cut(vals[0], " "); ok {
			if id := ID(strings.TrimSpace(key)); id != "" {
				return "key:" + id
			}
		}
	}
	if id, ok := meshtls.PeerIdentity(ctx); ok {
		return "mesh:" + id
	}
	return ""
}

func (a *Authenticator) log() *slog.Logger {
	if a.Log != nil {
		return a.Log
	}
	return slog.Default()
}

// Redact replaces every curfew API key in s by its prefix and id, for text that may hold
// one (an error, a log line).
func Redact(s string) string {
	if !strings.Contains(s, Prefix) {
		return s
	}
	var b strings.Builder
	for {
		i := strings.Index(s, Prefix)
		if i < 0 {
			b.WriteString(s)
			return b.String()
		}
		b.WriteString(s[:i])
		rest := s[i:]
		n := len(Prefix) + idLen + 1 + secretLen
		if len(rest) >= n {
			if id, _, err := Parse(rest[:n]); err == nil {
				fmt.Fprintf(&b, "%s%s_[REDACTED]", Prefix, id)
				s = rest[n:]
				continue
			}
		}
		b.WriteString(Prefix)
		s = rest[len(Prefix):]
	}
}

// Bearer returns per-call credentials that send key as `authorization: Bearer <key>` on
// every call of a connection (grpc.WithPerRPCCredentials). They are sent over plaintext
// too (RequireTransportSecurity is false): a mesh started with `curfew up --insecure` is
// plaintext on loopback and its callers must still authenticate.
func Bearer(key string) credentials.PerRPCCredentials { return bearer(key) }

type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{Header: "Bearer " + string(b)}, nil
}

func (b bearer) RequireTransportSecurity() bool { return false }
