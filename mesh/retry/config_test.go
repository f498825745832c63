package retry_test

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "retry.json")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

const fullFile = `{
  "default": {"max_attempts": 4, "base": "10ms", "cap": "400ms", "min_attempt_time": "5ms"},
  "budget": {"ratio": 0.5, "per_second": 0, "window": "30s"},
  "throttle": true,
  "targets": {
    "toolrunner": {
      "default": {"cap": "100ms"},
      "methods": {
        "/curfew.toolrunner.v1.ToolRunnerService/Execute": {"max_attempts": 2, "non_idempotent": true},
        "/curfew.toolrunner.v1.ToolRunnerService/Other": {"disabled": true}
      }
    },
    "modelproxy": {
      "methods": {"/curfew.modelproxy.v1.ModelProxyService/Generate": {"base": "50ms"}}
    }
  }
}`

func TestLoadFileInheritance(t *testing.T) {
	f, err := retry.LoadFile(writeFile(t, fullFile))
	if err != nil {
		t.Fatalf("LoadFile: %v", err)
	}
	ms := time.Millisecond
	fileDefault := retry.Policy{MaxAttempts: 4, Base: 10 * ms, Cap: 400 * ms, MinAttemptTime: 5 * ms}

	// A target not in the file: the file's default, no method policies.
	other := f.For("orchestrator")
	if other.Target != "orchestrator" || other.Default != fileDefault || other.Methods != nil || !other.Throttle {
		t.Errorf("For(orchestrator) = %+v", other)
	}
	if other.Budget.Ratio != 0.5 || other.Budget.PerSecond != 0 || other.Budget.Window != 30*time.Second {
		t.Errorf("budget = %+v, want ratio 0.5, per_second 0 (explicit), window 30s", other.Budget)
	}

	// The target's default overrides the file's; its methods start from the target's default.
	tr := f.For("toolrunner")
	targetDefault := fileDefault
	targetDefault.Cap = 100 * ms
	if tr.Default != targetDefault {
		t.Errorf("toolrunner default = %+v, want %+v", tr.Default, targetDefault)
	}
	exec := targetDefault
	exec.MaxAttempts, exec.NonIdempotent = 2, true
	if got := tr.Methods["/curfew.toolrunner.v1.ToolRunnerService/Execute"]; got != exec {
		t.Errorf("Execute policy = %+v, want %+v", got, exec)
	}
	off := targetDefault
	off.Disabled = true
	if got := tr.Methods["/curfew.toolrunner.v1.ToolRunnerService/Other"]; got != off {
		t.Errorf("Other policy = %+v, want %+v", got, off)
	}

	// A target with methods and no default: methods start from the file's default.
	mp := f.For("modelproxy")
	if mp.Default != fileDefault {
		t.Errorf("modelproxy default = %+v, want the file's", mp.Default)
	}
	gen := fileDefault
	gen.Base = 50 * ms
	if got := mp.Methods["/curfew.modelproxy.v1.ModelProxyService/Generate"]; got != gen {
		t.Errorf("Generate policy = %+v, want %+v", got, gen)
	}
	for _, target := range []string{"orchestrator", "toolrunner", "modelproxy"} {
		if err := f.For(target).Validate(); err != nil {
			t.Errorf("For(%s).Validate() = %v", target, err)
		}
	}
}

func TestLoadFileBudgetExplicitZeroAndDefaults(t *testing.T) {
	// per_second 0 given: no floor, so 20 % of 10 requests is 2 retries.
	f, err := retry.LoadFile(writeFile(t, `{"budget": {"ratio": 0.2, "per_second": 0}}`))
	if err != nil {
		t.Fatal(err)
	}
	b := retry.NewBudget(f.For("x").Budget, newClock().Now)
	for range 10 {
		b.Request()
	}
	if got := spend(b, 100); got != 2 {
		t.Errorf("ratio 0.2, per_second 0, 10 requests: %d retries, want 2", got)
	}
	// Budget left out: the defaults (0.2, 10/s, 10s).
	f, err = retry.LoadFile(writeFile(t, `{}`))
	if err != nil {
		t.Fatal(err)
	}
	got := f.For("x").Budget.WithDefaults()
	if got.Ratio != retry.DefaultBudgetRatio || got.PerSecond != retry.DefaultBudgetPerSecond || got.Window != retry.DefaultBudgetWindow {
		t.Errorf("empty file budget = %+v, want the defaults", got)
	}
	// Only the ratio given: per_second keeps its default.
	f, err = retry.LoadFile(writeFile(t, `{"budget": {"ratio": 0.5}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.For("x").Budget.WithDefaults(); got.Ratio != 0.5 || got.PerSecond != retry.DefaultBudgetPerSecond {
		t.Errorf("ratio-only budget = %+v, want ratio 0.5 and per_second %v", got, retry.DefaultBudgetPerSecond)
	}
	// Only per_second given: the ratio keeps its default.
	f, err = retry.LoadFile(writeFile(t, `{"budget": {"per_second": 0}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.For("x").Budget.WithDefaults(); got.Ratio != retry.DefaultBudgetRatio || got.PerSecond != 0 {
		t.Errorf("per_second-only budget = %+v, want ratio %v and per_second 0", got, retry.DefaultBudgetRatio)
	}
}

func TestLoadFileEmpty(t *testing.T) {
	f, err := retry.LoadFile(writeFile(t, `{}`))
	if err != nil {
		t.Fatal(err)
	}
	cfg := f.For("anything")
	if cfg.Default != (retry.Policy{}) || cfg.Methods != nil || cfg.Throttle {
		t.Errorf("empty file config = %+v", cfg)
	}
}

func TestLoadFileErrors(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       []string
	}{
		{"unknown top-level field", `{"defaults": {}}`, []string{"unknown field", "defaults"}},
		{"unknown policy field", `{"default": {"max_attempt": 2}}`, []string{"unknown field", "max_attempt"}},
		{"unknown target field", `{"targets": {"t": {"method": {}}}}`, []string{"unknown field", "method"}},
		{"unknown method policy field", `{"targets": {"t": {"methods": {"/a/b": {"jitter": true}}}}}`, []string{"unknown field", "jitter"}},
		{"unknown budget field", `{"budget": {"rate": 1}}`, []string{"unknown field", "rate"}},
		{"duration as a number", `{"default": {"base": 25}}`, []string{"duration is a string"}},
		{"malformed duration", `{"default": {"cap": "soon"}}`, []string{"soon"}},
		{"window as a number", `{"budget": {"window": 10}}`, []string{"duration is a string"}},
		{"not json", `max_attempts = 3`, []string{"invalid character"}},
		{"default out of bounds", `{"default": {"max_attempts": 6}}`, []string{"default:", "max_attempts must be between 1 and 5"}},
		{"target default out of bounds", `{"targets": {"toolrunner": {"default": {"max_attempts": 9}}}}`, []string{"targets.toolrunner", "max_attempts"}},
		{"target method out of bounds", `{"targets": {"modelproxy": {"methods": {"/m/x": {"base": "1s", "cap": "10ms"}}}}}`, []string{"targets.modelproxy", "method /m/x", "exceeds cap"}},
		{"inherited base above target cap", `{"default": {"base": "200ms"}, "targets": {"t1": {"default": {"cap": "100ms"}}}}`, []string{"targets.t1", "exceeds cap"}},
		{"negative duration", `{"targets": {"t2": {"default": {"min_attempt_time": "-1ms"}}}}`, []string{"targets.t2", "negative"}},
		{"budget out of bounds", `{"budget": {"ratio": 11}}`, []string{"budget", "ratio"}},
		{"negative budget", `{"budget": {"per_second": -1}}`, []string{"budget"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, tc.body)
			f, err := retry.LoadFile(p)
			if err == nil {
				t.Fatalf("LoadFile(%s) = %+v, want an error", tc.body, f)
			}
			if !strings.Contains(err.Error(), p) {
				t.Errorf("error %q does not name the file", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestLoadFileMissing(t *testing.T) {
	_, err := retry.LoadFile(filepath.Join(t.TempDir(), "absent.json"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("LoadFile(absent) = %v, want ErrNotExist", err)
	}
}

func TestDurationUnmarshal(t *testing.T) {
	var d retry.Duration
	if err := d.UnmarshalJSON([]byte(`"1m30s"`)); err != nil || time.Duration(d) != 90*time.Second {
		t.Fatalf("1m30s → %v, %v", time.Duration(d), err)
	}
	if err := d.UnmarshalJSON([]byte(`"250"`)); err == nil {
		t.Fatal(`"250" (no unit) parsed`)
	}
}

func TestConfigValidate(t *testing.T) {
	good := retry.Config{Default: retry.Policy{MaxAttempts: 2}, Methods: map[string]retry.Policy{"/a/b": {MaxAttempts: 5}}}
	if err := good.Validate(); err != nil {
		t.Fatalf("Validate = %v", err)
	}
	bad := retry.Config{Methods: map[string]retry.Policy{"/svc/Bad": {MaxAttempts: 7}}}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "/svc/Bad") {
		t.Fatalf("Validate = %v, want an error naming /svc/Bad", err)
	}
	if err := (retry.Config{Default: retry.Policy{MaxAttempts: 6}}).Validate(); err == nil {
		t.Fatal("default with 6 attempts validated")
	}
	if err := (retry.Config{Budget: retry.BudgetConfig{Ratio: -1}}).Validate(); err == nil {
		t.Fatal("negative budget ratio validated")
	}
}
