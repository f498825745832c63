package e2e

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/store"
)

var updateScreenshots = flag.Bool("update-screenshots", false, "write the console's screenshots to docs/img (the README shows them)")

// chromium starts headless Chromium (Debian's, $CURFEW_CHROMIUM) with a fresh profile and
// returns a browser context.
func chromium(t *testing.T) context.Context {
	t.Helper()
	exe := os.Getenv("CURFEW_CHROMIUM")
	if exe == "" {
		for _, p := range []string{"/usr/bin/chromium", "/usr/bin/chromium-browser"} {
			if _, err := os.Stat(p); err == nil {
				exe = p
				break
			}
		}
	}
	if exe == "" {
		meshproc.Missing(t, "chromium not installed (apt-get install chromium; scripts/test.sh does)")
	}
	dir, err := os.MkdirTemp("", "curfew-chromium-")
	if err != nil {
		t.Fatal(err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe), chromedp.UserDataDir(dir), chromedp.WindowSize(1280, 1000),
		chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-dev-shm-usage", true),
	)
	actx, cancelA := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelB := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancelB()
		cancelA()
		// Chromium's children may write to the profile a moment after it stops.
		for range 50 {
			if os.RemoveAll(dir) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	if err := chromedp.Do(ctx); err != nil { // starts the browser
		t.Fatalf("start %s: %v", exe, err)
	}
	return ctx
}

// browse runs browser steps with a bound of d.
func browse(ctx context.Context, t *testing.T, d time.Duration, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if err := chromedp.Do(c, steps...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// value runs one browser action that returns a value, with a bound of d.
func value[T any](ctx context.Context, t *testing.T, d time.Duration, what string, a chromedp.Action[T]) T {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	v, err := chromedp.Run(c, a)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

// pageNode is a node row of a run page as the browser shows it.
type pageNode struct {
	ID                string `json:"id"`
	Kind              string `json:"kind"`
	Status            string `json:"status"`
	Cause             string `json:"cause"`
	TokensAfterCancel string `json:"tac"`
}

const readNodes = `Array.from(document.querySelectorAll("tr.node")).map(tr => ({id: tr.dataset.node, kind: tr.dataset.kind,
  status: tr.dataset.status, cause: tr.dataset.cause, tac: tr.dataset.tokensAfterCancel}))`

// A tenant signs in on replica A and starts a run from the console; the run's page,
// opened on replica B, shows its nodes as they start; Cancel there stops the whole tree
// with cause operator, decoders frozen within a token, and the timeline draws the
// deadline and the cancel. An operator then opens the health page. Screenshots of both
// go to a temporary directory (docs/img with -update-screenshots).
func TestConsoleInBrowser(t *testing.T) {
	r := newConsoleRig(t)
	ctx := chromium(t)
	keyA := r.scopedKey(t, "console-browser")
	shots := t.TempDir()
	if *updateScreenshots {
		repo, err := meshproc.Repo()
		if err != nil {
			t.Fatal(err)
		}
		shots = filepath.Join(repo, "docs", "img")
	}

	// Sign in on A with the tenant's key, and start a run with the form.
	browse(ctx, t, 30*time.Second, "sign in on A",
		chromedp.Navigate(r.consA+"/signin"),
		chromedp.WaitVisible(chromedp.ID("key")),
		chromedp.SendKeys(chromedp.ID("key"), keyA),
		chromedp.Submit(chromedp.ID("key")),
		chromedp.WaitVisible(chromedp.CSS("details.start")),
		chromedp.Click(chromedp.CSS("details.start summary")),
		chromedp.SetValue(chromedp.ID("st-task"), consolePlan),
		chromedp.SetValue(chromedp.ID("st-timeout"), "90s"),
		chromedp.Submit(chromedp.ID("st-task")),
		chromedp.WaitVisible(chromedp.ID("live")),
	)
	loc := value(ctx, t, 10*time.Second, "location", chromedp.Location())
	path := strings.TrimPrefix(loc, r.consA)
	if !strings.HasPrefix(path, "/runs/console-browser/") {
		t.Fatalf("after starting a run the browser is at %s", loc)
	}
	runID := path[strings.LastIndexByte(path, '/')+1:]

	// Open it on B: the nodes appear while the run runs. The test's own observer notes
	// when the page first shows each node in each status (the browser's clock), to
	// measure how late node events reach it.
	browse(ctx, t, 30*time.Second, "open the run on B", chromedp.Navigate(r.consB+path), chromedp.WaitVisible(chromedp.ID("live")))
	value(ctx, t, 10*time.Second, "observe the nodes", chromedp.Evaluate[bool](`(() => {
	  window.seen = {};
	  const note = () => document.querySelectorAll("tr.node").forEach(tr => {
	    const k = tr.dataset.node + " " + tr.dataset.status;
	    if (!(k in window.seen)) window.seen[k] = Date.now();
	  });
	  note();
	  new MutationObserver(note).observe(document.getElementById("live"), {childList: true, subtree: true});
	  return true;
	})()`))
	var nodes []pageNode
	deadline := time.Now().Add(30 * time.Second)
	for {
		nodes = value(ctx, t, 10*time.Second, "read the nodes", chromedp.Evaluate[[]pageNode](readNodes))
		running := 0
		for _, n := range nodes {
			if n.Status == "running" {
				running++
			}
		}
		// The run, its tool, the subagent and the subagent's decoder.
		if running >= 4 && slices.ContainsFunc(nodes, func(n pageNode) bool { return n.Kind == "model" && n.Status == "running" }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the page on B shows %+v after 30s; want the tree running, its decoder too", nodes)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The countdown to the deadline runs while the run does.
	// Read in one evaluation: each view event replaces the live part, countdown included,
	// so a node looked up first may be gone when its text is asked for.
	if cd := value(ctx, t, 10*time.Second, "read the countdown", chromedp.Evaluate[string](
		`(document.getElementById("countdown") || {}).textContent || ""`)); !strings.HasPrefix(cd, "deadline in ") {
		t.Errorf("countdown %q, want \"deadline in …\"", cd)
	}
	runningAtCancel := map[string]bool{}
	for _, n := range nodes {
		runningAtCancel[n.ID] = n.Status == "running"
	}

	// When the page first showed each node running (read before the cancel reloads it).
	seen := value(ctx, t, 10*time.Second, "read the arrival times", chromedp.Evaluate[map[string]float64](`window.seen`))

	// Cancel, with a reason, on B. The reason field is focused in one evaluation: until
	// then each view event replaces the live part, and a node looked up first may be gone
	// when it is focused; from then on the page holds its updates (the focus is in the
	// part), so the keys and the click reach the nodes they were aimed at.
	if !value(ctx, t, 10*time.Second, "focus the reason", chromedp.Evaluate[bool](
		`(() => { const el = document.getElementById("reason"); el.focus(); return document.activeElement === el; })()`)) {
		t.Fatal("the reason field did not take the focus")
	}
	browse(ctx, t, 60*time.Second, "cancel on B",
		chromedp.KeyEvent("e2e: stop it"),
		chromedp.Click(chromedp.ID("cancel")),
		chromedp.WaitVisible(chromedp.ID("cancel-line")),
	)
	deadline = time.Now().Add(30 * time.Second)
	for {
		nodes = value(ctx, t, 10*time.Second, "read the nodes", chromedp.Evaluate[[]pageNode](readNodes))
		if !slices.ContainsFunc(nodes, func(n pageNode) bool { return n.Status == "running" }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30s after the cancel the page shows %+v; want no node running", nodes)
		}
		time.Sleep(100 * time.Millisecond)
	}
	decoders := 0
	for _, n := range nodes {
		if runningAtCancel[n.ID] && (n.Status != "cancelled" || n.Cause != "operator") {
			t.Errorf("node %s, running at the cancel, ended %s (cause %q); want cancelled by the operator", n.ID, n.Status, n.Cause)
		}
		if n.Kind == "model" {
			decoders++
			if tac, _ := strconv.Atoi(n.TokensAfterCancel); tac > 1 {
				t.Errorf("decoder %s: %d tokens after the cancel, want at most 1", n.ID, tac)
			}
		}
	}
	if decoders == 0 {
		t.Error("the page shows no model node")
	}
	lines := value(ctx, t, 10*time.Second, "read the timeline", chromedp.Evaluate[int](`document.querySelectorAll("#deadline-line, #cancel-line").length`))
	status := value(ctx, t, 10*time.Second, "read the status", chromedp.Text(chromedp.ID("run-status")))
	if lines != 2 || !strings.Contains(status, "cancelled") {
		t.Errorf("timeline lines %d (want the deadline's and the cancel's), run status %q", lines, status)
	}
	// The run's record agrees with the page.
	got, err := r.st.GetRun(t.Context(), "console-browser", runID)
	if err != nil || got.Status != store.StatusCancelled || got.Cause != "operator" {
		t.Errorf("the run in the store: %s cause %q (%v)", got.Status, got.Cause, err)
	}
	// How late node events reached the page: the browser's first sight of each node
	// running against the node's start as the services recorded it (one machine, one clock).
	resp, err := tenantClientKey(t, r.b, keyA).GetRun(t.Context(), &orchestratorv1.GetRunRequest{RunId: runID})
	if err != nil {
		t.Fatal(err)
	}
	var lags []time.Duration
	for _, n := range resp.GetRun().GetNodes() {
		if at, ok := seen[n.GetId()+" running"]; ok && n.GetStartedAt() != nil {
			lags = append(lags, time.UnixMilli(int64(at)).Sub(n.GetStartedAt().AsTime()))
		}
	}
	t.Logf("node start to the page (browser clock), %d nodes: %v", len(lags), lags)
	screenshot(ctx, t, r.consB+path, filepath.Join(shots, "console-run.png"))
	accessible(ctx, t, "the run page")

	// An operator: the one-time link of orchestrator-a signs the local operator in.
	browse(ctx, t, 30*time.Second, "operator's health page",
		chromedp.Navigate(r.consA+"/signin/link?token="+r.token),
		chromedp.WaitVisible(chromedp.ID("runrows")),
		chromedp.Navigate(r.consB+"/health"),
		chromedp.WaitVisible(chromedp.ID("orphan-delta")),
	)
	healthText := value(ctx, t, 10*time.Second, "read the health page", chromedp.Text(chromedp.CSS("main")))
	for _, want := range []string{"Pools", "Breakers", "Decoders", "Dead letters", "Orphan delta"} {
		if !strings.Contains(healthText, want) {
			t.Errorf("the health page lacks %q", want)
		}
	}
	screenshot(ctx, t, r.consB+"/health", filepath.Join(shots, "console-health.png"))
	accessible(ctx, t, "the health page")
	// The operator sees every tenant's runs, this one among them.
	browse(ctx, t, 30*time.Second, "operator's run list", chromedp.Navigate(r.consB+"/runs"), chromedp.WaitVisible(chromedp.ID("runrows")))
	list := value(ctx, t, 10*time.Second, "read the list", chromedp.Text(chromedp.ID("runrows")))
	accessible(ctx, t, "the run list")
	// The list refreshes itself (every 5 s): a run started now appears without a reload.
	later, err := tenantClientKey(t, r.a, keyA).StartRun(t.Context(), &orchestratorv1.StartRunRequest{
		Task: `{"steps": [{"answer_tokens": 1}]}`, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if strings.Contains(value(ctx, t, 10*time.Second, "read the list", chromedp.Text(chromedp.ID("runrows"))), later.GetRun().GetRunId()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run %s started after the list was opened is not on it after 20s", later.GetRun().GetRunId())
		}
	}
	if !strings.Contains(list, runID) || !strings.Contains(list, "console-browser") {
		t.Errorf("the operator's list lacks the tenant's run %s", runID)
	}
}

// axeViolation is one rule axe-core found broken on a page.
type axeViolation struct {
	ID     string `json:"id"`
	Impact string `json:"impact"`
	Help   string `json:"help"`
	Nodes  int    `json:"nodes"`
}

// accessible runs axe-core (scripts/axe, pinned) in the page the browser shows and fails
// t for every serious or critical violation of WCAG 2.1 A and AA.
func accessible(ctx context.Context, t *testing.T, page string) {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(filepath.Join(repo, ".tools", "axe", "node_modules", "axe-core", "axe.min.js"))
	if err != nil {
		meshproc.Missing(t, "axe-core not installed (scripts/node.sh axe): %v", err)
		return
	}
	value(ctx, t, 10*time.Second, "load axe-core", chromedp.Evaluate[bool](string(src)+";true"))
	const audit = `axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]}})
	  .then(r => ({passes: r.passes.length, violations: r.violations.map(v => ({id: v.id, impact: v.impact || "", help: v.help, nodes: v.nodes.length}))}))`
	type report struct {
		Passes     int            `json:"passes"`
		Violations []axeViolation `json:"violations"`
	}
	got := value(ctx, t, 30*time.Second, "axe on "+page, chromedp.Evaluate[report](audit, chromedp.EvalAwaitPromise))
	if got.Passes == 0 {
		t.Errorf("%s: axe-core checked no rule", page)
	}
	t.Logf("%s: axe-core, %d rules pass, %d violated", page, got.Passes, len(got.Violations))
	for _, v := range got.Violations {
		if v.Impact == "serious" || v.Impact == "critical" {
			t.Errorf("%s: accessibility, %s (%s): %s, %d elements", page, v.ID, v.Impact, v.Help, v.Nodes)
		} else {
			t.Logf("%s: accessibility, %s (%s): %s, %d elements", page, v.ID, v.Impact, v.Help, v.Nodes)
		}
	}
}

func screenshot(ctx context.Context, t *testing.T, u, file string) {
	t.Helper()
	browse(ctx, t, 30*time.Second, "open "+u, chromedp.Navigate(u), chromedp.WaitReady(chromedp.CSS("main")), chromedp.Sleep(300*time.Millisecond))
	png := value(ctx, t, 30*time.Second, "screenshot "+u, chromedp.FullScreenshot(100))
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot %s (%d bytes)", file, len(png))
}
