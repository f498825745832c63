package console

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Config.
const (
	// DefaultSessionTTL is how long a session lasts after sign-in.
	DefaultSessionTTL = 12 * time.Hour
	// DefaultListRefresh is how often an open run list reloads itself.
	DefaultListRefresh = 5 * time.Second
	// DefaultSignoutPoll bounds how long a sign-out on another replica takes to hold here.
	DefaultSignoutPoll = 2 * time.Second
	// MinSecretLen is the least length of the console secret, in bytes.
	MinSecretLen = 32
)

// csp is the Content-Security-Policy of every response: nothing but this origin's own
// script, style and images, no inline script or style, no framing.
const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config is a console's configuration.
type Config struct {
	// Orchestrator, DeadLetters and Admin are clients of the orchestrator's own gRPC
	// listener (loopback), so that every call passes its server chain with the user's
	// key. DeadLetters is nil without a shared store (no dead letters are kept).
	Orchestrator orchestratorv1.OrchestratorServiceClient
	DeadLetters  orchestratorv1.DeadLetterServiceClient
	Admin        adminv1.AdminServiceClient
	// Store lists runs (the list's filters are store queries) and keeps sign-outs.
	Store store.Store
	// Keys checks the keys users sign in with; nil (an orchestrator without a store)
	// lets no one sign in with a key.
	Keys *apikey.Authenticator
	// Secret keys the sessions: the same on every replica, at least MinSecretLen bytes.
	Secret []byte
	// Secure marks the cookies Secure: the browser reaches the console over TLS (its own,
	// or an ingress's).
	Secure bool
	// SignInToken, when set, is a one-time sign-in link's token (`curfew up` prints the
	// link): its first use signs in the local operator with a new admin key of tenant
	// default, and it is then spent.
	SignInToken string
	// TraceURL, when set, is the address of a run's trace, {run_id} replaced by the run's
	// id (a Jaeger or Tempo search by the curfew.run_id attribute).
	TraceURL string
	// SessionTTL, ListRefresh and SignoutPoll default to the Default* constants.
	SessionTTL, ListRefresh, SignoutPoll time.Duration
	// Log receives errors a user is not shown; nil: slog.Default().
	Log *slog.Logger
}

// Handler serves the console.
type Handler struct {
	cfg      Config
	seal     *sealer
	signouts *signouts
	pages    map[string]*template.Template
	mux      *http.ServeMux

	linkMu    sync.Mutex
	linkSpent bool
}

// New returns the console of cfg.
func New(cfg Config) (*Handler, error) {
	if cfg.Orchestrator == nil || cfg.Admin == nil || cfg.Store == nil {
		return nil, errors.New("console: Orchestrator, Admin and Store are required")
	}
	if len(cfg.Secret) < MinSecretLen {
		return nil, fmt.Errorf("console: the secret must be at least %d bytes, not %d", MinSecretLen, len(cfg.Secret))
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.ListRefresh <= 0 {
		cfg.ListRefresh = DefaultListRefresh
	}
	if cfg.SignoutPoll <= 0 {
		cfg.SignoutPoll = DefaultSignoutPoll
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	seal, err := newSealer(cfg.Secret)
	if err != nil {
		return nil, err
	}
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	h := &Handler{cfg: cfg, seal: seal, signouts: &signouts{st: cfg.Store, poll: cfg.SignoutPoll}, pages: pages, mux: http.NewServeMux()}
	h.routes()
	return h, nil
}

// Route is one entry of the console's route table.
type Route struct {
	Method, Pattern string
	// Changes is true for the routes that change something: each needs the CSRF token.
	Changes bool
	// Public is true for the routes served without a session.
	Public  bool
	handler func(http.ResponseWriter, *http.Request, *user)
}

// Routes returns the console's route table; path values are in braces, as http.ServeMux
// takes them.
func (h *Handler) Routes() []Route {
	return []Route{
		{Method: "GET", Pattern: "/signin", Public: true, handler: h.signinForm},
		{Method: "POST", Pattern: "/signin", Public: true, Changes: true, handler: h.signin},
		{Method: "GET", Pattern: "/signin/link", Public: true, handler: h.signinLink},
		{Method: "POST", Pattern: "/signout", Changes: true, handler: h.signout},
		{Method: "GET", Pattern: "/{$}", handler: func(w http.ResponseWriter, r *http.Request, _ *user) {
			http.Redirect(w, r, "/runs", http.StatusSeeOther)
		}},
		{Method: "GET", Pattern: "/runs", handler: h.runList},
		{Method: "POST", Pattern: "/runs", Changes: true, handler: h.startRun},
		{Method: "GET", Pattern: "/runs/{tenant}/{run}", handler: h.runPage},
		{Method: "GET", Pattern: "/runs/{tenant}/{run}/view", handler: h.runView},
		{Method: "GET", Pattern: "/runs/{tenant}/{run}/events", handler: h.runEvents},
		{Method: "POST", Pattern: "/runs/{tenant}/{run}/cancel", Changes: true, handler: h.cancelRun},
		{Method: "POST", Pattern: "/runs/{tenant}/{run}/approval", Changes: true, handler: h.decide},
		{Method: "GET", Pattern: "/health", handler: h.health},
		{Method: "GET", Pattern: "/dead-letters", handler: h.deadLetters},
		{Method: "POST", Pattern: "/dead-letters/{tenant}/{id}/replay", Changes: true, handler: h.replay},
	}
}

func (h *Handler) routes() {
	for _, rt := range h.Routes() {
		h.mux.HandleFunc(rt.Method+" "+rt.Pattern, h.wrap(rt))
	}
	static, _ := fs.Sub(staticFS, "static")
	files := http.StripPrefix("/static/", http.FileServer(http.FS(static)))
	h.mux.Handle("GET /static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=3600")
		files.ServeHTTP(w, r)
	}))
}

// ServeHTTP serves a request with the console's security headers.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("Content-Security-Policy", csp)
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Referrer-Policy", "same-origin")
	hd.Set("X-Frame-Options", "DENY")
	if h.cfg.Secure {
		hd.Set("Strict-Transport-Security", "max-age=31536000")
	}
	h.mux.ServeHTTP(w, r)
}

// wrap checks a route's session and CSRF token before its handler. Pages are never
// cached: what one user sees is not kept for another.
func (h *Handler) wrap(rt Route) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("Vary", "Cookie")
		if rt.Public {
			rt.handler(w, r, nil)
			return
		}
		u, err := h.user(r)
		if err != nil {
			h.cfg.Log.DebugContext(r.Context(), "console session refused", "path", r.URL.Path, "error", err.Error())
			h.setCookie(w, sessionCookie, "", time.Time{})
			if r.Method == http.MethodGet && !strings.HasSuffix(r.URL.Path, "/events") && !strings.HasSuffix(r.URL.Path, "/view") {
				http.Redirect(w, r, "/signin?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusSeeOther)
				return
			}
			http.Error(w, "sign in first", http.StatusUnauthorized)
			return
		}
		if rt.Changes && !h.seal.checkToken(u.ID, r.PostFormValue("csrf")) {
			http.Error(w, "missing or wrong CSRF token", http.StatusForbidden)
			return
		}
		rt.handler(w, r, u)
	}
}

// user returns the request's verified session: sealed by this console's secret, not
// expired, not signed out, and its key still valid.
func (h *Handler) user(r *http.Request) (*user, error) {
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return nil, err
	}
	s, err := h.seal.open(c.Value)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	if now.After(s.Exp) {
		return nil, errors.New("session expired")
	}
	if h.cfg.Keys == nil {
		return nil, errors.New("this orchestrator keeps no API keys")
	}
	out, err := h.signouts.has(r.Context(), s.ID, now)
	if err != nil {
		return nil, fmt.Errorf("cannot check sign-outs: %w", err)
	}
	if out {
		return nil, errors.New("signed out")
	}
	rec, err := h.cfg.Keys.Lookup(r.Context(), s.Key)
	if err != nil {
		return nil, err
	}
	return &user{session: s, rec: rec}, nil
}

// as is ctx for a call to the orchestrator acting as u for tenant: u's key, and, for an
// operator, the tenant named (the guard lets only operators' keys name one).
func as(ctx context.Context, u *user, tenant string) context.Context {
	kv := []string{apikey.Header, "Bearer " + u.Key}
	if tenant != "" && tenant != u.Tenant() {
		kv = append(kv, md.Tenant, tenant)
	}
	return metadata.NewOutgoingContext(ctx, metadata.Pairs(kv...))
}

// httpStatus maps a call's error to the HTTP status the console answers with: the
// canonical mapping of google.rpc codes (grpc-gateway's, which HTTP front ends of gRPC
// services share).
func httpStatus(err error) int { return runtime.HTTPStatusFromCode(status.Code(err)) }

// fail answers a failed call: its status's message for the user's own errors, a generic
// one (the detail logged) for the server's.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, u *user, what string, err error) {
	code := httpStatus(err)
	msg := status.Convert(err).Message()
	if code >= 500 && code != http.StatusServiceUnavailable && code != http.StatusGatewayTimeout {
		h.cfg.Log.ErrorContext(r.Context(), "console", "what", what, "path", r.URL.Path, "error", err.Error())
		msg = "internal error"
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	h.render(w, r, "error", u, map[string]any{"Title": http.StatusText(code), "What": what, "Message": msg, "Code": code})
}
