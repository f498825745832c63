package console

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Cookie names.
const (
	sessionCookie = "curfew_session"
	// preCookie holds the CSRF token of the sign-in form, before there is a session.
	preCookie = "curfew_signin"
)

// session is what the cookie holds, encrypted.
type session struct {
	ID  string    `json:"sid"`
	Key string    `json:"key"` // the API key signed in with
	Exp time.Time `json:"exp"`
}

// user is a request's verified session: its key's record.
type user struct {
	session
	rec store.APIKey
}

// Operator reports whether the user signed in with an operator's key (every tenant).
func (u *user) Operator() bool {
	return slices.Contains(u.rec.Scopes, store.ScopeAdmin) || slices.Contains(u.rec.Scopes, store.ScopeReadOnly)
}

// CanChange reports whether the user may cancel, approve and replay: a tenant on its own
// runs, an operator with the admin scope on every tenant's.
func (u *user) CanChange() bool {
	return !u.Operator() || slices.Contains(u.rec.Scopes, store.ScopeAdmin)
}

// Admin reports whether the user may decide approvals (operators with the admin scope).
func (u *user) Admin() bool { return slices.Contains(u.rec.Scopes, store.ScopeAdmin) }

// Tenant is the user's key's tenant.
func (u *user) Tenant() string { return u.rec.Tenant }

// sealer encrypts sessions and derives their CSRF tokens from the console secret.
type sealer struct {
	aead cipher.AEAD
	csrf []byte
}

func newSealer(secret []byte) (*sealer, error) {
	if len(secret) < MinSecretLen {
		return nil, errors.New("console secret too short")
	}
	k := sha256.Sum256(append([]byte("curfew-console-session\x00"), secret...))
	block, err := aes.NewCipher(k[:])
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	c := sha256.Sum256(append([]byte("curfew-console-csrf\x00"), secret...))
	return &sealer{aead: aead, csrf: c[:]}, nil
}

func (s *sealer) seal(v session) (string, error) {
	plain, err := json.Marshal(v)
	if err != nil {
		return "", err
	}
	nonce := make([]byte, s.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(s.aead.Seal(nonce, nonce, plain, []byte(sessionCookie))), nil
}

func (s *sealer) open(cookie string) (session, error) {
	var v session
	b, err := base64.RawURLEncoding.DecodeString(cookie)
	if err != nil || len(b) < s.aead.NonceSize() {
		return v, errors.New("malformed session")
	}
	plain, err := s.aead.Open(nil, b[:s.aead.NonceSize()], b[s.aead.NonceSize():], []byte(sessionCookie))
	if err != nil {
		return v, errors.New("session not sealed with this console's secret")
	}
	if err := json.Unmarshal(plain, &v); err != nil {
		return v, err
	}
	return v, nil
}

// token is the CSRF token bound to id (a session id, or the sign-in form's nonce).
func (s *sealer) token(id string) string {
	m := hmac.New(sha256.New, s.csrf)
	m.Write([]byte(id))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (s *sealer) checkToken(id, got string) bool {
	return got != "" && subtle.ConstantTimeCompare([]byte(s.token(id)), []byte(got)) == 1
}

// randomID is 128 random bits, URL-safe.
func randomID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}

// signouts is the set of sessions signed out before they expired, read from the store's
// controls at most every poll, so that a sign-out on one replica holds on every one.
type signouts struct {
	st   store.Operators
	poll time.Duration

	mu    sync.Mutex
	read  time.Time
	ended map[string]time.Time // session id → its expiry
}

func (s *signouts) has(ctx context.Context, id string, now time.Time) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now.Sub(s.read) >= s.poll || s.ended == nil {
		cs, err := s.st.ListControls(ctx)
		if err != nil {
			// A store that cannot answer cannot vouch that the session was not ended:
			// refuse, as the key check would.
			return false, err
		}
		ended := map[string]time.Time{}
		for _, c := range cs {
			if c.Kind != store.ControlConsoleSignedOut {
				continue
			}
			if !c.Until.IsZero() && now.After(c.Until) {
				// Expired anyway: the row is no longer needed.
				_, _, _ = s.st.DeleteControl(ctx, c.Kind, c.Target)
				continue
			}
			ended[c.Target] = c.Until
		}
		s.ended, s.read = ended, now
	}
	_, ok := s.ended[id]
	return ok, nil
}

func (s *signouts) add(ctx context.Context, u *user) error {
	_, _, err := s.st.PutControl(ctx, store.Control{Kind: store.ControlConsoleSignedOut, Target: u.ID, Tenant: u.Tenant(),
		Reason: "signed out of the web console", Actor: "key:" + u.rec.ID, Until: u.Exp})
	if err != nil {
		return err
	}
	s.mu.Lock()
	if s.ended == nil {
		s.ended = map[string]time.Time{}
	}
	s.ended[u.ID] = u.Exp
	s.mu.Unlock()
	return nil
}

// setCookie sets a cookie of the console: HttpOnly, SameSite=Strict, Secure when the
// browser reaches the console over TLS.
func (h *Handler) setCookie(w http.ResponseWriter, name, value string, exp time.Time) {
	c := &http.Cookie{Name: name, Value: value, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: h.cfg.Secure} //nolint:gosec // Secure whenever the browser reaches the console over TLS; plain HTTP only on loopback
	if exp.IsZero() {
		c.MaxAge = -1
	} else {
		c.Expires = exp
		c.MaxAge = int(time.Until(exp).Seconds())
	}
	http.SetCookie(w, c)
}
