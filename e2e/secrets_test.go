package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
)

// Secrets: a run whose model provider needs an API key, and a call that carries
// a curfew API key as its authorization metadata, leave no key material in any service's
// log (at debug level, the most verbose), in the run's summary, or in the CLI's --json
// output. The provider refuses a request without the key, so the run's success proves the
// key was used.
func TestSecretsNeverLeak(t *testing.T) {
	t.Parallel()
	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		t.Fatal(err)
	}
	providerKey := "sk-curfew-e2e-" + hex.EncodeToString(raw)
	up := startUpstream(t, "-api-key", providerKey)
	keyFile := filepath.Join(t.TempDir(), "provider.key")
	if err := os.WriteFile(keyFile, []byte(providerKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fileJSON := `{"providers": [{"name": "keyed", "base_url": "{keyed}", "api_key_file": "` + keyFile + `", "models": ["big"]}],
	  "models": {"agent": {"chain": ["keyed/big"]}}}`
	// The services inherit curfew up's environment: debug is their most verbose level,
	// and their spans go to a real OTLP receiver.
	col := startCollector(t)
	m := startProviderMesh(t, fileJSON, map[string]*upstream{"keyed": up}, "CURFEW_LOG_LEVEL=debug",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://"+col.addr, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc", "OTEL_TRACES_EXPORTER=otlp", "OTEL_BSP_SCHEDULE_DELAY=200")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tenantKey := tenantKeyOf(ctx, t, m, "acme", false)

	up.enqueue(t, `{"content": ["the", " answer"]}`)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tenantKey)
	fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "answer", Model: "agent"})
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetTenant() != "acme" {
		t.Fatalf("run ended %v for tenant %q (the provider refuses requests without the key): %s", fin.GetStatus(), fin.GetTenant(), dump(fin))
	}

	cmd := exec.Command(filepath.Join(m.Bin, "curfew"), "get", fin.GetRunId(), "--json", "--data-dir", m.Dir)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			t.Fatal(err)
		}
	}
	texts := map[string]string{"curfew get --json": out.String() + errb.String(), "run summary": dump(fin)}
	logs, err := filepath.Glob(filepath.Join(m.Dir, "logs", "*.log"))
	if err != nil || len(logs) < 4 {
		t.Fatalf("service logs %v (%v)", logs, err)
	}
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			t.Fatal(err)
		}
		texts[filepath.Base(l)] = string(b)
	}
	// The spans of all four services, once modelproxy's (the provider call) has arrived.
	for deadline := time.Now().Add(30 * time.Second); ; {
		b, _ := os.ReadFile(col.out)
		spans, _ := parseSpans(bytes.NewReader(b))
		if slices.ContainsFunc(spans, func(s span) bool { return s.service == "modelproxy" && s.attrs["curfew.run_id"] == fin.GetRunId() }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no spans of run %s from modelproxy within 30s", fin.GetRunId())
		}
		time.Sleep(200 * time.Millisecond)
	}
	col.stop(t)
	spans, err := os.ReadFile(col.out)
	if err != nil {
		t.Fatal(err)
	}
	texts["traces (the collector's detailed text)"] = string(spans)
	_, tenantSecret, _ := apikey.Parse(tenantKey)
	for where, text := range texts {
		for name, secret := range map[string]string{"the provider key": providerKey, "the curfew API key's secret": tenantSecret} {
			if strings.Contains(text, secret) {
				t.Errorf("%s holds %s", where, name)
			}
		}
	}
	if !strings.Contains(texts["modelproxy.log"], `"level":"DEBUG"`) {
		t.Error("modelproxy did not log at debug level: the check above proves less than it says")
	}
}
