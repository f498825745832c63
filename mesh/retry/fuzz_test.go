package retry_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

// FuzzLoadFile: a --retry-config file is refused with an error or yields policies that
// validate, for every target; it never crashes the service at start.
func FuzzLoadFile(f *testing.F) {
	f.Add([]byte(`{"default": {"max_attempts": 3, "base": "50ms", "cap": "1s"}, "targets": {"toolrunner": {"max_attempts": 2, "methods": {"/curfew.toolrunner.v1.ToolRunnerService/Execute": {"max_attempts": 1}}}}}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"default": {"max_attempts": 9}}`))
	f.Add([]byte(`{"default": {"base": 5}}`))
	f.Add([]byte(`{"targets": {"": {}}}`))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		p := filepath.Join(dir, "retry.json")
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		file, err := retry.LoadFile(p)
		if err != nil {
			return
		}
		if err := file.Validate(); err != nil {
			t.Fatalf("LoadFile accepted a file that does not validate: %v", err)
		}
	})
}
