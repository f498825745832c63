package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// The web console (docs/console.md), served by two orchestrators on one PostgreSQL store:
// isolation between tenants walked over its whole route table, CSRF on every route that
// changes something, and (console_browser_test.go) a real browser watching a run on the
// replica that does not own it and cancelling it there.

// consoleRig is a cluster of two orchestrators with the console on, sharing its secret.
type consoleRig struct {
	*crashRig
	a, b         *meshproc.Proc
	consA, consB string // http://127.0.0.1:port
	token        string // the one-time sign-in link's, on orchestrator-a
}

func newConsoleRig(t *testing.T) *consoleRig {
	t.Helper()
	r := &consoleRig{crashRig: newCrashRig(t, storetest.PostgresDSN(t))}
	secret := filepath.Join(r.c.Dir, "console.secret")
	if err := os.WriteFile(secret, []byte("e2e-console-secret-0123456789abcdef-0123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	r.token = "e2e-one-time-" + fmt.Sprint(time.Now().UnixNano())
	tokenFile := filepath.Join(r.c.Dir, "console.token")
	if err := os.WriteFile(tokenFile, []byte(r.token), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func(name string, extra ...string) (*meshproc.Proc, string) {
		addr := freeAddr(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		args := append([]string{"--console-addr", addr, "--console-secret-file", secret}, extra...)
		p, err := r.c.Add(ctx, "orchestrator", name, r.c.OrchestratorArgs(r.model, r.sub, r.tools, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatal(err)
		}
		waitHTTP(t, "http://"+addr+"/signin")
		return p, "http://" + addr
	}
	r.a, r.consA = start("orchestrator-a", "--console-signin-token-file", tokenFile)
	r.b, r.consB = start("orchestrator-b")
	return r
}

func waitHTTP(t *testing.T, u string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(u)
		if err == nil {
			_ = resp.Body.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", u, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// scopedKey makes an API key of tenant with scopes and returns it whole.
func (r *consoleRig) scopedKey(t *testing.T, tenant string, scopes ...string) string {
	t.Helper()
	k, err := apikey.New(tenant)
	if err != nil {
		t.Fatal(err)
	}
	k.Record.Scopes = scopes
	if _, _, err := r.st.CreateAPIKey(t.Context(), k.Record, false); err != nil {
		t.Fatal(err)
	}
	return k.Secret
}

// browser is an HTTP client with a session of the console: cookies, and the CSRF token
// its pages carry.
type browser struct {
	t    *testing.T
	c    *http.Client
	csrf string
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// signIn signs in at console base with key, as the sign-in form does.
func signIn(t *testing.T, base, key string) *browser {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	b := &browser{t: t, c: &http.Client{Jar: jar, Timeout: 30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	code, body := b.get(base + "/signin")
	m := csrfField.FindStringSubmatch(body)
	if code != http.StatusOK || m == nil {
		t.Fatalf("GET /signin: %d, no form token", code)
	}
	code, _ = b.post(base+"/signin", url.Values{"key": {key}, "csrf": {m[1]}, "next": {"/runs"}})
	if code != http.StatusSeeOther {
		t.Fatalf("POST /signin: %d, want 303", code)
	}
	code, body = b.get(base + "/runs")
	if m = csrfField.FindStringSubmatch(body); code != http.StatusOK || m == nil {
		t.Fatalf("GET /runs after sign-in: %d", code)
	}
	b.csrf = m[1]
	return b
}

func (b *browser) get(u string) (int, string) {
	b.t.Helper()
	resp, err := b.c.Get(u)
	if err != nil {
		b.t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(body)
}

func (b *browser) post(u string, form url.Values) (int, string) {
	b.t.Helper()
	resp, err := b.c.PostForm(u, form)
	if err != nil {
		b.t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(body)
}

// consoleRoute is one line of the console's route table.
type consoleRoute struct {
	method, pattern string
	csrf, public    bool
}

// consoleRoutes reads the route table the console's own test keeps equal to its routes.
func consoleRoutes(t *testing.T) []consoleRoute {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(repo, "services/orchestrator/internal/console/testdata/routes.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	var out []consoleRoute
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if line := sc.Text(); line != "" && !strings.HasPrefix(line, "#") {
			fs := strings.Fields(line)
			out = append(out, consoleRoute{method: fs[0], pattern: fs[1], csrf: slices.Contains(fs, "csrf"), public: slices.Contains(fs, "public")})
		}
	}
	if len(out) < 10 {
		t.Fatalf("%d routes in the table", len(out))
	}
	return out
}

// path is the route's pattern with its values.
func (r consoleRoute) path(vals map[string]string) string {
	p := strings.ReplaceAll(r.pattern, "{$}", "")
	for k, v := range vals {
		p = strings.ReplaceAll(p, "{"+k+"}", url.PathEscape(v))
	}
	return p
}

// consolePlan keeps a tree busy for a minute: a tool sleeping with progress beside a
// subagent whose decoder streams slowly.
const consolePlan = `{"tokens_per_second": 50, "steps": [
  {"think_tokens": 5, "tools": [
    {"name": "sleep", "args": {"ms": 60000, "progress_ms": 250}},
    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 20, "steps": [
      {"think_tokens": 3000, "tools": [{"name": "sleep", "args": {"ms": 1}}]}, {"answer_tokens": 1}]}}}]},
  {"answer_tokens": 5}]}`

func TestConsoleIsolationAndCSRF(t *testing.T) {
	r := newConsoleRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	keyA, keyB := r.scopedKey(t, "console-a"), r.scopedKey(t, "console-b")
	resp, err := tenantClientKey(t, r.a, keyA).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: consolePlan, Timeout: durationpb.New(90 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	runA := resp.GetRun().GetRunId()
	dl, _, err := r.st.AddDeadLetter(ctx, store.DeadLetter{Tenant: "console-a", RunID: runA, Step: "0", ErrorType: "tool_error", Attempts: 3,
		LastError: "secret-of-tenant-A", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	nodeA := "root"

	// The console is not served unless enabled: not on an orchestrator's other listeners.
	for _, addr := range []string{r.a.AdminAddr} {
		resp, err := http.Get("http://" + addr + "/signin")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				t.Errorf("the admin listener %s serves /signin", addr)
			}
		}
	}

	routes := consoleRoutes(t)
	b := signIn(t, r.consB, keyB) // tenant B, on either replica
	for _, base := range []string{r.consA, r.consB} {
		for _, rt := range routes {
			if rt.public || rt.pattern == "/signout" {
				continue
			}
			for _, tenant := range []string{"console-a", "console-b"} {
				p := rt.path(map[string]string{"tenant": tenant, "run": runA, "id": dl.ID})
				var code int
				var body string
				if rt.method == "GET" {
					code, body = b.get(base + p)
				} else {
					code, body = b.post(base+p, url.Values{"csrf": {b.csrf}, "node": {nodeA}, "decision": {"approve"}, "reason": {"e2e"},
						"task": {"B's run"}, "tenant": {"console-a"}})
				}
				// A's data: its run's task, its dead letter's error. (A refusal may name
				// the id it was asked for; that is no leak.)
				if strings.Contains(body, "spawn_subagent") || strings.Contains(body, "secret-of-tenant-A") {
					t.Errorf("%s %s%s as tenant B: the body shows tenant A's run or dead letter", rt.method, base, p)
				}
				takesNoIDs := !strings.Contains(strings.ReplaceAll(rt.pattern, "{$}", ""), "{")
				switch {
				case takesNoIDs && rt.method == "GET":
					// Lists and pages of the user's own: served, without A's ids (above);
					// the operators' health page is refused by the admin service.
					if rt.pattern == "/health" && code != http.StatusForbidden {
						t.Errorf("GET %s as a tenant: %d, want 403", p, code)
					}
					if (rt.pattern == "/runs" || rt.pattern == "/dead-letters") && (code != http.StatusOK || strings.Contains(body, runA) || strings.Contains(body, dl.ID)) {
						t.Errorf("GET %s as tenant B: %d, or it lists tenant A's run or dead letter", p, code)
					}
				case takesNoIDs: // POST /runs: a run of B's own, whatever the form names
				case code != http.StatusNotFound && code != http.StatusForbidden:
					t.Errorf("%s %s%s as tenant B: %d, want 404 or 403", rt.method, base, p, code)
				}
			}
		}
	}
	// Nothing of A's changed: its run still runs, its dead letter was not replayed, and
	// B's POST /runs started runs of B only.
	got, err := r.st.GetRun(ctx, "console-a", runA)
	if err != nil || got.Status.Terminal() {
		t.Errorf("tenant A's run after B's walk: %s (%v), want still running", got.Status, err)
	}
	if d, err := r.st.GetDeadLetter(ctx, "console-a", dl.ID); err != nil || !d.ReplayedAt.IsZero() {
		t.Errorf("tenant A's dead letter after B's walk: replayed at %v (%v)", d.ReplayedAt, err)
	}
	if runs, _, err := r.st.ListRuns(ctx, store.RunQuery{Tenant: "console-a"}); err != nil || len(runs) != 1 {
		t.Errorf("tenant A has %d runs after B's walk (%v), want 1", len(runs), err)
	}

	// Every route that changes something refuses a request without the CSRF token, even
	// with A's own session and ids.
	a := signIn(t, r.consA, keyA)
	for _, rt := range routes {
		if !rt.csrf {
			continue
		}
		p := rt.path(map[string]string{"tenant": "console-a", "run": runA, "id": dl.ID})
		for _, form := range []url.Values{{}, {"csrf": {"forged"}}, {"csrf": {b.csrf}}} {
			form.Set("task", "csrf probe")
			form.Set("key", keyA)
			form.Set("reason", "csrf probe")
			if code, _ := a.post(r.consA+p, form); code != http.StatusForbidden {
				t.Errorf("POST %s with csrf %q: %d, want 403", p, form.Get("csrf"), code)
			}
		}
	}
	if got, err := r.st.GetRun(ctx, "console-a", runA); err != nil || got.Status.Terminal() {
		t.Errorf("tenant A's run after the CSRF probes: %s (%v), want still running", got.Status, err)
	}
	if runs, _, err := r.st.ListRuns(ctx, store.RunQuery{Tenant: "console-a"}); err != nil || len(runs) != 1 {
		t.Errorf("tenant A has %d runs after the CSRF probes (%v), want 1", len(runs), err)
	}
	// With the token, A cancels its own run through the replica that does not own it.
	if code, _ := a.post(r.consB+"/runs/console-a/"+runA+"/cancel", url.Values{"csrf": {a.csrf}, "reason": {"e2e done"}}); code != http.StatusSeeOther {
		t.Errorf("A's cancel with its token via orchestrator-b: %d, want 303", code)
	}
	if got, err := r.st.GetRun(ctx, "console-a", runA); err != nil || got.Cause != "operator" {
		t.Errorf("tenant A's run after its cancel: %s cause %q (%v), want cause operator", got.Status, got.Cause, err)
	}
	// Signing out holds on the other replica too (once it has polled the sign-outs), for
	// the cookie as it was before: a copy kept elsewhere no longer works.
	if code, _ := a.get(r.consB + "/runs"); code != http.StatusOK {
		t.Fatalf("A's session on orchestrator-b before sign-out: %d", code)
	}
	consoleURL, _ := url.Parse(r.consA)
	kept := a.c.Jar.Cookies(consoleURL)
	if code, _ := a.post(r.consA+"/signout", url.Values{"csrf": {a.csrf}}); code != http.StatusSeeOther {
		t.Fatalf("sign out: %d", code)
	}
	a.c.Jar.SetCookies(consoleURL, kept)
	time.Sleep(2500 * time.Millisecond) // DefaultSignoutPoll with margin
	if code, _ := a.get(r.consB + "/runs"); code != http.StatusSeeOther {
		t.Errorf("a signed-out session on orchestrator-b: %d, want a redirect to sign in", code)
	}
}

// An operator's console sees another tenant's run waiting for approval and approves it
// on the replica that does not own it; a read-only operator may look but not cancel.
func TestConsoleOperatorApproves(t *testing.T) {
	r := newConsoleRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	keyA := r.scopedKey(t, "console-approve")
	resp, err := tenantClientKey(t, r.a, keyA).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: approvalPlan("console-approve"),
		Timeout: durationpb.New(90 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()
	page := r.consB + "/runs/console-approve/" + id

	reader := signIn(t, r.consB, r.scopedKey(t, "ops", store.ScopeReadOnly))
	if code, body := reader.get(page); code != http.StatusOK || strings.Contains(body, `value="approve"`) || strings.Contains(body, `id="cancel"`) {
		t.Errorf("a read-only operator's run page: %d, or it offers Approve or Cancel", code)
	}
	if code, _ := reader.post(page+"/cancel", url.Values{"csrf": {reader.csrf}, "reason": {"read-only"}}); code != http.StatusForbidden {
		t.Errorf("a read-only operator's cancel: %d, want 403", code)
	}

	op := signIn(t, r.consB, r.scopedKey(t, "ops", store.ScopeAdmin))
	deadline := time.Now().Add(30 * time.Second)
	for {
		code, body := op.get(page)
		if code == http.StatusOK && strings.Contains(body, `value="approve"`) && strings.Contains(body, approvalNode) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the operator's run page offers no approval after 30s (%d)", code)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if code, _ := op.post(page+"/approval", url.Values{"csrf": {op.csrf}, "node": {approvalNode}, "decision": {"approve"}, "reason": {"looks fine"}}); code != http.StatusSeeOther {
		t.Fatalf("approve: %d, want 303", code)
	}
	deadline = time.Now().Add(30 * time.Second)
	for {
		got, err := r.st.GetRun(ctx, "console-approve", id)
		if err == nil && got.Status.Terminal() {
			if got.Status != store.StatusSucceeded {
				t.Fatalf("the approved run ended %s: %s", got.Status, got.Error)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the approved run is %s after 30s (%v)", got.Status, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	rows, err := r.st.ListOutbox(ctx, "console-approve", 0, 100)
	if err != nil || len(rows) != 1 || rows[0].Channel != "console-approve" {
		t.Errorf("the tenant's outbox after the approval: %d rows (%v), want the approved notification", len(rows), err)
	}
}

// A tenant sees its dead letter in the console and replays it; pressing Replay twice
// runs the step once.
func TestConsoleReplaysADeadLetterOnce(t *testing.T) {
	r := newConsoleRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := r.scopedKey(t, "console-dlq")
	plan := `{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 2, "tools": [{"name": "fail", "args": {"code": "INVALID_ARGUMENT", "times": 5}}]},
	  {"answer_tokens": 1}]}`
	resp, err := tenantClientKey(t, r.a, key).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, IdempotencyKey: "console-dlq-1",
		Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	var d store.DeadLetter
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		dls, _, err := r.st.ListDeadLetters(ctx, store.DeadLetterQuery{Tenant: "console-dlq", RunID: resp.GetRun().GetRunId()})
		if err == nil && len(dls) == 1 {
			d = dls[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no dead letter for the failing run after 30s (%v)", err)
		}
	}
	b := signIn(t, r.consB, key)
	if code, body := b.get(r.consB + "/dead-letters"); code != http.StatusOK || !strings.Contains(body, d.ID) || !strings.Contains(body, "/replay") {
		t.Fatalf("GET /dead-letters: %d, without the tenant's dead letter %s and its Replay", code, d.ID)
	}
	var runs []string
	for range 2 {
		res, err := b.c.PostForm(r.consB+"/dead-letters/console-dlq/"+d.ID+"/replay", url.Values{"csrf": {b.csrf}})
		if err != nil {
			t.Fatal(err)
		}
		_ = res.Body.Close()
		loc := res.Header.Get("Location")
		if res.StatusCode != http.StatusSeeOther || !strings.HasPrefix(loc, "/runs/console-dlq/") {
			t.Fatalf("replay: %d to %q, want the replay run's page", res.StatusCode, loc)
		}
		runs = append(runs, loc)
	}
	if runs[0] != runs[1] {
		t.Errorf("two replays opened two runs: %v", runs)
	}
	if got, err := r.st.GetDeadLetter(ctx, "console-dlq", d.ID); err != nil || got.ReplayedAt.IsZero() {
		t.Errorf("the dead letter after its replay: %+v (%v)", got, err)
	}
}

// tenantClientKey is a client of orchestrator p (plaintext) with key.
func tenantClientKey(t *testing.T, p *meshproc.Proc, key string) orchestratorv1.OrchestratorServiceClient {
	t.Helper()
	conn, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(apikey.Bearer(key)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return orchestratorv1.NewOrchestratorServiceClient(conn)
}
