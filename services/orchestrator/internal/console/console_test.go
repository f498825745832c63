package console

import (
	"context"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
)

var update = flag.Bool("update", false, "rewrite testdata/routes.txt")

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newHandler is a console on a private memory store whose gRPC clients reach nothing:
// enough for what does not call the orchestrator.
func newHandler(t *testing.T) (*Handler, store.Store) {
	t.Helper()
	st, err := memory.OpenOr(t.Context(), "", "console-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	cc, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	h, err := New(Config{Orchestrator: orchestratorv1.NewOrchestratorServiceClient(cc), Admin: adminv1.NewAdminServiceClient(cc),
		Store: st, Keys: &apikey.Authenticator{Keys: st}, Secret: []byte(strings.Repeat("s", 32)), SignInToken: "one-time-token-1234"})
	if err != nil {
		t.Fatal(err)
	}
	return h, st
}

// The route table is kept in testdata/routes.txt, which the end-to-end isolation test
// (e2e/console_test.go) walks whole: a route added without it fails here.
func TestRouteTableIsTheGoldenOne(t *testing.T) {
	h, _ := newHandler(t)
	var b strings.Builder
	b.WriteString("# The web console's routes: method, pattern, and whether the route changes something (csrf) or is served\n# without a session (public). Rewrite with: go test ./internal/console/ -run RouteTable -update\n")
	for _, r := range h.Routes() {
		b.WriteString(r.Method + " " + r.Pattern)
		if r.Changes {
			b.WriteString(" csrf")
		}
		if r.Public {
			b.WriteString(" public")
		}
		b.WriteString("\n")
		if r.Method == http.MethodPost && !r.Changes {
			t.Errorf("%s %s changes state without a CSRF token", r.Method, r.Pattern)
		}
	}
	if *update {
		if err := os.WriteFile("testdata/routes.txt", []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile("testdata/routes.txt")
	if err != nil {
		t.Fatal(err)
	}
	if string(want) != b.String() {
		t.Errorf("routes changed; rewrite testdata/routes.txt with -update. Got:\n%s", b.String())
	}
}

func TestSessionsAreSealedAndBound(t *testing.T) {
	h, _ := newHandler(t)
	v, err := h.seal.seal(session{ID: "s1", Key: "cfk_x", Exp: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	got, err := h.seal.open(v)
	if err != nil || got.ID != "s1" || got.Key != "cfk_x" {
		t.Fatalf("open = %+v, %v", got, err)
	}
	if strings.Contains(v, "cfk_x") {
		t.Error("the cookie shows the key")
	}
	tampered := []byte(v)
	tampered[len(tampered)/2] ^= 1
	if _, err := h.seal.open(string(tampered)); err == nil {
		t.Error("a tampered cookie opened")
	}
	other, err := newSealer([]byte(strings.Repeat("o", 32)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.open(v); err == nil {
		t.Error("a cookie opened with another console secret")
	}
	if h.seal.token("s1") == h.seal.token("s2") || !h.seal.checkToken("s1", h.seal.token("s1")) || h.seal.checkToken("s1", "") {
		t.Error("CSRF tokens are not bound to their session")
	}
	if _, err := newSealer([]byte("short")); err == nil {
		t.Error("a short secret was taken")
	}
}

func TestNextStaysOnTheConsole(t *testing.T) {
	for in, want := range map[string]string{"/runs/t/r": "/runs/t/r", "": "/runs", "https://evil.example/": "/runs", "//evil.example": "/runs", "/\\evil": "/runs"} {
		if got := next(in); got != want {
			t.Errorf("next(%q) = %q, want %q", in, got, want)
		}
	}
}

// Every page carries the strict policy, and a page behind the session sends the browser
// to sign in; the one-time link works once.
func TestHeadersSigninAndOneTimeLink(t *testing.T) {
	h, st := newHandler(t)
	srv := httptest.NewServer(h)
	defer srv.Close()
	c := srv.Client()
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, err := c.Get(srv.URL + "/runs")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "/signin") {
		t.Errorf("GET /runs without a session: %d to %q, want a redirect to /signin", resp.StatusCode, resp.Header.Get("Location"))
	}
	if got := resp.Header.Get("Content-Security-Policy"); !strings.Contains(got, "script-src 'self'") || strings.Contains(got, "unsafe") {
		t.Errorf("CSP %q", got)
	}
	resp, err = c.Get(srv.URL + "/signin/link?token=one-time-token-1234")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	var cookie *http.Cookie
	for _, ck := range resp.Cookies() {
		if ck.Name == sessionCookie {
			cookie = ck
		}
	}
	if resp.StatusCode != http.StatusSeeOther || cookie == nil || !cookie.HttpOnly || cookie.SameSite != http.SameSiteStrictMode {
		t.Fatalf("one-time link: %d, cookie %+v", resp.StatusCode, cookie)
	}
	keys, err := st.ListAPIKeys(context.Background(), "")
	if err != nil || len(keys) != 1 || keys[0].Scopes[0] != store.ScopeAdmin {
		t.Errorf("the link made keys %+v (%v), want one admin key", keys, err)
	}
	resp, err = c.Get(srv.URL + "/signin/link?token=one-time-token-1234")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("the link's second use: %d, want 403", resp.StatusCode)
	}
}

func TestRunViewDrawsDeadlineAndCancel(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	at := func(ms int) *timestamppb.Timestamp {
		return timestamppb.New(t0.Add(time.Duration(ms) * time.Millisecond))
	}
	run := &orchestratorv1.Run{RunId: "r1", Tenant: "acme", Status: orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		CreatedAt: at(0), Deadline: at(60_000), CancelledAt: at(1000), EndedAt: at(1020),
		Nodes: []*meshv1.Node{
			{Id: "root", Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED, Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, StartedAt: at(0), EndedAt: at(1010)},
			{Id: "root/s0.t0", Status: meshv1.NodeStatus_NODE_STATUS_SUCCEEDED, StartedAt: at(200), EndedAt: at(400),
				EarlierAttempts: []*meshv1.AttemptRecord{{Attempt: 1, StartedAt: at(100), EndedAt: at(150)}}},
		}}
	v := newRunView(run, t0.Add(time.Hour), "", nil)
	if v.Live || v.Cancel == nil || v.Deadline == nil || !strings.Contains(v.Deadline.Label, "beyond") {
		t.Fatalf("view: live %v cancel %+v deadline %+v", v.Live, v.Cancel, v.Deadline)
	}
	if v.Cancel.X <= float64(labelW) || v.Cancel.X >= v.Deadline.X {
		t.Errorf("cancel at x=%v, deadline at x=%v: want the cancel on the axis, before the deadline", v.Cancel.X, v.Deadline.X)
	}
	if r := v.Rows[0]; r.State != "cancelled (operator)" || r.BarW <= 0 {
		t.Errorf("root row %+v", r)
	}
	if r := v.Rows[1]; len(r.Earlier) != 1 || r.Attempts != 2 || !strings.Contains(r.State, "attempt 2") {
		t.Errorf("retried row %+v", r)
	}
}

func TestApplyEventFollowsTextOffsets(t *testing.T) {
	run := &orchestratorv1.Run{}
	texts, pending, last := map[string]string{}, map[string]*meshv1.ApprovalGate{}, ""
	ev := func(text string, off int64) *orchestratorv1.WatchRunResponse {
		return &orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_NodeEvent{NodeEvent: &meshv1.NodeEvent{NodeId: "m",
			Kind: &meshv1.NodeEvent_Text{Text: &meshv1.TextDelta{Text: text, Offset: off}}}}}
	}
	for _, e := range []*orchestratorv1.WatchRunResponse{ev("Hel", 0), ev("lo", 3), ev("lo", 3), ev(" you", 5)} {
		applyEvent(run, e, texts, pending, &last)
	}
	if last != "Hello you" {
		t.Errorf("text %q, want %q", last, "Hello you")
	}
	applyEvent(run, &orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Node{Node: &meshv1.Node{Id: "m"}}}, texts, pending, &last)
	applyEvent(run, &orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Node{Node: &meshv1.Node{Id: "m", Tokens: 3}}}, texts, pending, &last)
	if len(run.Nodes) != 1 || run.Nodes[0].GetTokens() != 3 {
		t.Errorf("nodes %v, want one, updated", run.Nodes)
	}
}

// A session ends when it expires and when its key is revoked; pages are never cached.
func TestSessionsEndOnExpiryAndRevocation(t *testing.T) {
	h, st := newHandler(t)
	srv := httptest.NewServer(h)
	defer srv.Close()
	k, err := apikey.New("acme")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.CreateAPIKey(t.Context(), k.Record, false); err != nil {
		t.Fatal(err)
	}
	get := func(s session) *http.Response {
		t.Helper()
		v, err := h.seal.seal(s)
		if err != nil {
			t.Fatal(err)
		}
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, srv.URL+"/runs", nil)
		req.AddCookie(&http.Cookie{Name: sessionCookie, Value: v})
		c := srv.Client()
		c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp
	}
	live := session{ID: "s1", Key: k.Secret, Exp: time.Now().Add(time.Hour)}
	if resp := get(live); resp.StatusCode != http.StatusOK || resp.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("a live session: %d, Cache-Control %q; want 200, no-store", resp.StatusCode, resp.Header.Get("Cache-Control"))
	}
	if resp := get(session{ID: "s2", Key: k.Secret, Exp: time.Now().Add(-time.Second)}); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("an expired session: %d, want a redirect to sign in", resp.StatusCode)
	}
	if _, err := st.RevokeAPIKey(t.Context(), k.Record.ID); err != nil {
		t.Fatal(err)
	}
	if resp := get(live); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("a session whose key was revoked: %d, want a redirect to sign in", resp.StatusCode)
	}
}

// Over TLS (its own, or an ingress's) the cookies are Secure and the browser is told to
// stay on HTTPS.
func TestSecureConsoleMarksCookiesSecure(t *testing.T) {
	h, _ := newHandler(t)
	h.cfg.Secure = true
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/signin", nil))
	res := w.Result()
	_ = res.Body.Close()
	if len(res.Cookies()) == 0 || !res.Cookies()[0].Secure || res.Header.Get("Strict-Transport-Security") == "" {
		t.Errorf("over TLS: cookies %+v, HSTS %q", res.Cookies(), res.Header.Get("Strict-Transport-Security"))
	}
}
