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
	cases := append(meshtest.CommonFlagCases(), []meshtest.FlagCase{
		{Name: "negative decode time", Args: []string{"--min-decode-time=-1s"}, Want: "--min-decode-time must not be negative"},
		{Name: "negative decode time from env", Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "-5ms"}, Want: "--min-decode-time must not be negative"},
		{Name: "bad decode time from env", Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "fast"}, Want: "CURFEW_MIN_DECODE_TIME"},
		{Name: "flag wins over env", Args: []string{"--min-decode-time=-1s"}, Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "fast"}, Want: "must not be negative"},
		{Name: "negative lease ttl", Args: []string{"--decoder-lease-ttl=-1s"}, Want: "--decoder-lease-ttl: must be 0 (off) or at least 50ms"},
		{Name: "lease ttl below the minimum from env", Env: map[string]string{"CURFEW_DECODER_LEASE_TTL": "10ms"}, Want: "--decoder-lease-ttl"},
		{Name: "bad lease ttl from env", Env: map[string]string{"CURFEW_DECODER_LEASE_TTL": "soon"}, Want: "CURFEW_DECODER_LEASE_TTL"},
		{Name: "missing providers file", Args: []string{"--providers-config=/nonexistent/providers.json"}, Want: "--providers-config"},
		{Name: "invalid providers file from env", Env: map[string]string{"CURFEW_PROVIDERS_CONFIG": badProviders(t)}, Want: "unknown provider"},
		{Name: "missing admission file", Args: []string{"--admission-config=/nonexistent/admission.json"}, Want: "--admission-config"},
		{Name: "invalid admission file from env", Env: map[string]string{"CURFEW_ADMISSION_CONFIG": badAdmission(t)}, Want: "admission: pools[0].max_in_flight 0"},
		{Name: "unknown store scheme", Args: []string{"--store=mysql://db/curfew"}, Want: "--store"},
		{Name: "unreachable store from env", Env: map[string]string{"CURFEW_STORE": "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"}, Want: "--store"},
	}...)
	meshtest.RunFlagCases(t, "modelproxy", run, cases)
}

// badProviders writes a providers file whose alias names a provider that does not exist.
func badProviders(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "providers.json")
	b := `{"providers": [{"name": "p", "base_url": "http://127.0.0.1:1/v1", "models": ["m"]}], "models": {"a": {"chain": ["q/m"]}}}`
	if err := os.WriteFile(p, []byte(b), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// badAdmission writes an admission file whose only pool has no slots.
func badAdmission(t *testing.T) string {
	p := filepath.Join(t.TempDir(), "admission.json")
	if err := os.WriteFile(p, []byte(`{"pools": [{"name": "paid", "max_in_flight": 0}], "tenants": {"acme": {"token_budget": 10}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
