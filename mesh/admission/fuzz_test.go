package admission_test

import (
	"bytes"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// FuzzDecode: an operator's admission file must be refused with an error, never crash the
// orchestrator, and a file that is accepted yields a valid, fully defaulted config.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"pools": [{"name": "paid", "max_in_flight": 2}, {"name": "overflow", "max_in_flight": 8, "overflow": true, "slack_shed": true}]}`))
	f.Add([]byte(`{"cancel_grace": "1s", "fail_closed_window": "1m", "retry_after": "250ms", "pools": [{"name": "p", "max_in_flight": 1, "max_queue": 3, "max_queue_age": "2s"}], "default_tenant": {"max_in_flight": 4, "token_budget": 1000, "window": "1h"}, "tenants": {"acme": {"token_budget": 5}}}`))
	f.Add([]byte(`{"pools": []}`))
	f.Add([]byte(`{"pools": [{"name": "Bad Name", "max_in_flight": 0}]}`))
	f.Add([]byte(`{"cancel_grace": 5}`))
	f.Add([]byte(`{} {}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := admission.Decode(bytes.NewReader(data))
		if err != nil {
			return
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("Decode accepted a config that does not validate: %v", err)
		}
		if _, err := admission.New(cfg, nil); err != nil {
			t.Fatalf("Decode accepted a config New refuses: %v", err)
		}
	})
}
