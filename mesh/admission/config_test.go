package admission_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

func TestDefaultConfig(t *testing.T) {
	cfg := admission.DefaultConfig()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(cfg.Pools) != 2 || cfg.Pools[0].Name != "paid" || cfg.Pools[0].MaxInFlight != 2 ||
		cfg.Pools[1].Name != "overflow" || !cfg.Pools[1].Overflow {
		t.Errorf("pools %+v, want the seed's paid (2) and overflow", cfg.Pools)
	}
	if cfg.CancelGrace != time.Second || cfg.FailClosedWindow != time.Minute {
		t.Errorf("grace %v window %v", cfg.CancelGrace, cfg.FailClosedWindow)
	}
	if l := cfg.TenantLimits("anyone"); l.TokenBudget != 0 || l.MaxInFlight != 0 {
		t.Errorf("default tenant limits %+v, want none", l)
	}
}

// The example of docs/admission.md.
const exampleFile = `{
  "service": "orchestrator",
  "pools": [
    {"name": "paid", "max_in_flight": 2, "max_queue": 1000, "max_queue_age": "30s"},
    {"name": "overflow", "max_in_flight": 8, "overflow": true}
  ],
  "cancel_grace": "1s",
  "fail_closed_window": "1m",
  "retry_after": "1s",
  "default_tenant": {"max_in_flight": 16},
  "tenants": {
    "acme": {"max_in_flight": 4, "token_budget": 200000, "window": "1h", "max_deadline": "2m",
             "request_rate": 100, "request_burst": 200}
  }
}`

func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "admission.json")
	if err := os.WriteFile(path, []byte(exampleFile), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := admission.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if p := cfg.Pools[1]; p.MaxQueue != admission.DefaultMaxQueue || p.MaxQueueAge != admission.DefaultMaxQueueAge || p.MaxInFlight != 8 {
		t.Errorf("overflow pool %+v: defaults not applied", p)
	}
	if p := cfg.Pools[0]; p.MaxQueue != 1000 || p.MaxQueueAge != 30*time.Second {
		t.Errorf("paid pool %+v", p)
	}
	if l := cfg.TenantLimits("acme"); l != (admission.TenantLimits{MaxInFlight: 4, TokenBudget: 200000, Window: time.Hour, MaxDeadline: 2 * time.Minute,
		RequestRate: 100, RequestBurst: 200}) {
		t.Errorf("acme %+v", l)
	}
	if l := cfg.TenantLimits("other"); l != (admission.TenantLimits{MaxInFlight: 16, Window: admission.DefaultBudgetWindow}) {
		t.Errorf("default tenant %+v", l)
	}
	if _, err := admission.New(cfg, nil); err != nil {
		t.Fatal(err)
	}

	if _, err := admission.Load(filepath.Join(t.TempDir(), "missing.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

func TestDecodeErrors(t *testing.T) {
	pools := `"pools": [{"name": "paid", "max_in_flight": 2}, {"name": "overflow", "max_in_flight": 8, "overflow": true}]`
	for _, tc := range []struct{ name, doc, want string }{
		{"unknown field", `{` + pools + `, "grace": "1s"}`, `unknown field "grace"`},
		{"unknown pool field", `{"pools": [{"name": "paid", "max_in_flight": 2, "cap": 3}]}`, `unknown field "cap"`},
		{"duration as number", `{` + pools + `, "cancel_grace": 1000}`, `a duration is a string`},
		{"bad duration", `{` + pools + `, "fail_closed_window": "a minute"}`, `invalid duration`},
		{"trailing data", `{` + pools + `} {}`, `data after the JSON document`},
		{"not JSON", `pools: []`, `decoding config`},
		{"no pools", `{}`, `pools []: at least one pool`},
		{"duplicate pool", `{"pools": [{"name": "paid", "max_in_flight": 2}, {"name": "paid", "max_in_flight": 1}]}`, `pools[1].name "paid": duplicate of pools[0]`},
		{"bad pool name", `{"pools": [{"name": "Paid Pool", "max_in_flight": 2}]}`, `pools[0].name`},
		{"zero cap", `{"pools": [{"name": "paid", "max_in_flight": 0}]}`, `pools[0].max_in_flight 0: must be at least 1`},
		{"negative queue", `{"pools": [{"name": "paid", "max_in_flight": 1, "max_queue": -1}]}`, `pools[0].max_queue -1`},
		{"negative queue age", `{"pools": [{"name": "paid", "max_in_flight": 1, "max_queue_age": "-1s"}]}`, `pools[0].max_queue_age`},
		{"two overflow pools", `{"pools": [{"name": "paid", "max_in_flight": 1}, {"name": "a", "max_in_flight": 1, "overflow": true}, {"name": "b", "max_in_flight": 1, "overflow": true}]}`, `pools[2].overflow true: pools[1] is already the overflow pool`},
		{"first pool overflow", `{"pools": [{"name": "free", "max_in_flight": 1, "overflow": true}]}`, `cannot be the overflow pool`},
		{"negative grace", `{` + pools + `, "cancel_grace": "-1s"}`, `cancel_grace`},
		{"negative budget", `{` + pools + `, "tenants": {"acme": {"token_budget": -5}}}`, `tenants["acme"].token_budget -5`},
		{"negative max deadline", `{` + pools + `, "tenants": {"acme": {"max_deadline": "-1s"}}}`, `tenants["acme"].max_deadline -1s`},
		{"negative request rate", `{` + pools + `, "tenants": {"acme": {"request_rate": -2}}}`, `tenants["acme"].request_rate -2`},
		{"empty tenant", `{` + pools + `, "tenants": {"": {"token_budget": 5}}}`, `a tenant id must not be empty`},
		{"negative default", `{` + pools + `, "default_tenant": {"max_in_flight": -1}}`, `default_tenant.max_in_flight`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := admission.Decode(strings.NewReader(tc.doc))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Decode: %v, want an error containing %q", err, tc.want)
			}
		})
	}
	var ce *admission.ConfigError
	_, err := admission.Decode(strings.NewReader(`{"pools": [{"name": "paid", "max_in_flight": 0}]}`))
	if !errors.As(err, &ce) || ce.Field != "pools[0].max_in_flight" {
		t.Errorf("validation error %v is not a *ConfigError naming the field", err)
	}
	if _, err := admission.New(admission.Config{}, nil); err == nil {
		t.Error("New accepted a config without pools")
	}
}
