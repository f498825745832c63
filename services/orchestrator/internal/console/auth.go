package console

import (
	"crypto/subtle"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// next is where to go after signing in: a path of this console, else the run list (an
// absolute or scheme-relative address would make the form an open redirect).
func next(v string) string {
	if !strings.HasPrefix(v, "/") || strings.HasPrefix(v, "//") || strings.HasPrefix(v, "/\\") {
		return "/runs"
	}
	return v
}

// signinForm shows the sign-in form. Its CSRF token is bound to a nonce in a cookie of
// its own (there is no session yet), so another site cannot sign a browser in.
func (h *Handler) signinForm(w http.ResponseWriter, r *http.Request, _ *user) {
	h.signinPage(w, r, http.StatusOK, "")
}

func (h *Handler) signinPage(w http.ResponseWriter, r *http.Request, code int, problem string) {
	nonce := randomID()
	h.setCookie(w, preCookie, nonce, time.Now().Add(time.Hour))
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	h.render(w, r, "signin", nil, map[string]any{"Title": "Sign in", "SigninCSRF": h.seal.token("signin:" + nonce),
		"Next": next(r.FormValue("next")), "Problem": problem, "NoKeys": h.cfg.Keys == nil})
}

// signin checks the key of the form and starts a session.
func (h *Handler) signin(w http.ResponseWriter, r *http.Request, _ *user) {
	c, err := r.Cookie(preCookie)
	if err != nil || !h.seal.checkToken("signin:"+c.Value, r.PostFormValue("csrf")) {
		http.Error(w, "missing or wrong CSRF token: reload the sign-in page", http.StatusForbidden)
		return
	}
	if h.cfg.Keys == nil {
		h.signinPage(w, r, http.StatusServiceUnavailable, "This orchestrator keeps no API keys (it runs without a shared store).")
		return
	}
	key := strings.TrimSpace(r.PostFormValue("key"))
	rec, err := h.cfg.Keys.Lookup(r.Context(), key)
	if err != nil {
		msg := "That API key is not valid (unknown, revoked or mistyped)."
		code := http.StatusUnauthorized
		if status.Code(err) != codes.Unauthenticated {
			msg, code = "The keys cannot be checked now; try again.", http.StatusServiceUnavailable
		}
		h.signinPage(w, r, code, msg)
		return
	}
	if err := h.startSession(w, key); err != nil {
		h.fail(w, r, nil, "sign in", err)
		return
	}
	h.cfg.Log.InfoContext(r.Context(), "console sign-in", "key_id", rec.ID, "tenant", rec.Tenant, "scopes", rec.Scopes)
	h.setCookie(w, preCookie, "", time.Time{})
	http.Redirect(w, r, next(r.PostFormValue("next")), http.StatusSeeOther) //nolint:gosec // next() keeps only a path of this console
}

func (h *Handler) startSession(w http.ResponseWriter, key string) error {
	s := session{ID: randomID(), Key: key, Exp: time.Now().Add(h.cfg.SessionTTL).Truncate(time.Second)}
	v, err := h.seal.seal(s)
	if err != nil {
		return err
	}
	h.setCookie(w, sessionCookie, v, s.Exp)
	return nil
}

// signinLink spends the one-time sign-in token: the local operator gets a session with a
// new admin key of tenant default (so that the audit names a key, as for any operator).
// A GET that changes state is the nature of such a link; the token is its CSRF defence,
// random and usable once.
func (h *Handler) signinLink(w http.ResponseWriter, r *http.Request, _ *user) {
	tok := r.URL.Query().Get("token")
	h.linkMu.Lock()
	ok := h.cfg.SignInToken != "" && !h.linkSpent && subtle.ConstantTimeCompare([]byte(tok), []byte(h.cfg.SignInToken)) == 1
	if ok {
		h.linkSpent = true
	}
	h.linkMu.Unlock()
	if !ok {
		h.signinPage(w, r, http.StatusForbidden, "That sign-in link is not valid or was already used: sign in with an API key.")
		return
	}
	if h.cfg.Keys == nil {
		h.signinPage(w, r, http.StatusServiceUnavailable, "This orchestrator keeps no API keys, so it cannot make the operator's.")
		return
	}
	k, err := apikey.New(md.DefaultTenant)
	if err != nil {
		h.fail(w, r, nil, "sign in", err)
		return
	}
	k.Record.Scopes = []string{store.ScopeAdmin}
	if _, _, err := h.cfg.Store.CreateAPIKey(r.Context(), k.Record, false); err != nil {
		h.fail(w, r, nil, "sign in", status.Error(codes.Unavailable, "cannot store the operator's key: "+err.Error()))
		return
	}
	if err := h.startSession(w, k.Secret); err != nil {
		h.fail(w, r, nil, "sign in", err)
		return
	}
	h.cfg.Log.InfoContext(r.Context(), "console sign-in by the one-time link", "key_id", k.Record.ID)
	http.Redirect(w, r, "/runs", http.StatusSeeOther)
}

// signout ends the session on every replica.
func (h *Handler) signout(w http.ResponseWriter, r *http.Request, u *user) {
	if err := h.signouts.add(r.Context(), u); err != nil {
		h.fail(w, r, u, "sign out", status.Error(codes.Unavailable, "cannot record the sign-out: "+err.Error()))
		return
	}
	h.setCookie(w, sessionCookie, "", time.Time{})
	http.Redirect(w, r, "/signin", http.StatusSeeOther)
}
