package cli

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// The client commands' key: $CURFEW_API_KEY first, checked; over plaintext, else the key
// curfew up --insecure left; over mTLS, none (the CLI is a mesh peer).
func TestAPIKeySources(t *testing.T) {
	data := t.TempDir()
	c := &common{dataDir: data}
	t.Setenv(APIKeyEnv, "")
	if k, err := c.apiKey(true); err != nil || k != "" {
		t.Fatalf("no key anywhere: %q, %v", k, err)
	}
	file, _ := apikey.New("default")
	if err := os.WriteFile(filepath.Join(data, CLIKeyFile), []byte(file.Secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if k, err := c.apiKey(true); err != nil || k != file.Secret {
		t.Fatalf("plaintext with DIR/cli.key: %q, %v", k, err)
	}
	if k, err := c.apiKey(false); err != nil || k != "" {
		t.Fatalf("mTLS with DIR/cli.key: %q, %v; want none", k, err)
	}
	env, _ := apikey.New("acme")
	t.Setenv(APIKeyEnv, env.Secret)
	for _, plaintext := range []bool{true, false} {
		if k, err := c.apiKey(plaintext); err != nil || k != env.Secret {
			t.Fatalf("$%s (plaintext %v): %q, %v", APIKeyEnv, plaintext, k, err)
		}
	}
	t.Setenv(APIKeyEnv, "hunter2")
	if _, err := c.apiKey(false); err == nil {
		t.Fatal("a malformed $CURFEW_API_KEY was accepted")
	}
}

// curfew up --insecure keeps DIR/cli.key while the store accepts it, and replaces it,
// with mode 0600, once revoked.
func TestPrepareCLIKey(t *testing.T) {
	ctx := t.Context()
	data := t.TempDir()
	dsn := "sqlite://" + filepath.Join(data, "curfew.db")
	path := filepath.Join(data, CLIKeyFile)
	read := func() (string, store.APIKey) {
		t.Helper()
		if err := prepareCLIKey(ctx, dsn, data); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", path, fi.Mode().Perm())
		}
		st, err := store.Open(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = st.Close() }()
		key := string(b[:len(b)-1])
		rec, err := st.GetAPIKey(ctx, apikey.ID(key))
		if err != nil || rec.Tenant != md.DefaultTenant || rec.Revoked() {
			t.Fatalf("the key in %s: %+v, %v", path, rec, err)
		}
		return key, rec
	}
	first, rec := read()
	if again, _ := read(); again != first {
		t.Fatal("a valid key was replaced")
	}
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.RevokeAPIKey(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	_ = st.Close()
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if next, _ := read(); next == first {
		t.Fatal("a revoked key was kept")
	}
}
