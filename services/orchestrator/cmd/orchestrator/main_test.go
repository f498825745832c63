package main

import (
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Only invalid configurations are tested: a valid one would start serving.
func TestRunRejectsBadConfiguration(t *testing.T) {
	writeFile := func(t *testing.T, content string) string {
		t.Helper()
		p := filepath.Join(t.TempDir(), "admission.json")
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cases := append(meshtest.CommonFlagCases(), []meshtest.FlagCase{
		{Name: "zero max runs", Args: []string{"--max-runs=0"}, Want: "--max-runs must be at least 1"},
		{Name: "negative run time from env", Env: map[string]string{"CURFEW_MIN_RUN_TIME": "-1s"}, Want: "--min-run-time"},
		{Name: "bad max runs from env", Env: map[string]string{"CURFEW_MAX_RUNS": "lots"}, Want: "CURFEW_MAX_RUNS"},
		{Name: "tiny lease TTL", Args: []string{"--lease-ttl=1ms"}, Want: "--lease-ttl must be at least 30ms"},
		{Name: "nats without store", Args: []string{"--nats=nats://127.0.0.1:4222"}, Want: "--nats needs --store"},
		{Name: "bad store DSN", Args: []string{"--store=mysql://x"}, Want: "--store"},
		{Name: "missing admission config", Args: []string{"--admission-config=/nonexistent/admission.json"}, Want: "--admission-config"},
		{Name: "bad admission config from env", Env: map[string]string{"CURFEW_ADMISSION_CONFIG": writeFile(t, `{"pools": [{"name": "paid", "max_in_flight": 0}]}`)}, Want: "--admission-config"},
	}...)
	meshtest.RunFlagCases(t, "orchestrator", run, cases)
}
