package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
)

func TestTenantKeys(t *testing.T) {
	ctx := t.Context()
	dsn := "sqlite://" + filepath.Join(t.TempDir(), "curfew.db")
	run := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := Main(ctx, append([]string{"tenant"}, append(args, "--store", dsn)...), nil, &out, &errb)
		return code, out.String(), errb.String()
	}
	newKey := func(sub, tenant string) map[string]any {
		t.Helper()
		code, out, errs := run(sub, tenant, "--json")
		if code != ExitOK {
			t.Fatalf("tenant %s %s: exit %d: %s", sub, tenant, code, errs)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			t.Fatalf("%s: %v", out, err)
		}
		return m
	}
	first := newKey("create", "acme")
	second := newKey("create", "acme")
	other := newKey("create", "globex")

	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	auth := &apikey.Authenticator{Keys: st}
	tenantOf := func(key any) (string, error) {
		return auth.Tenant(metadata.NewIncomingContext(context.WithoutCancel(ctx), metadata.Pairs("authorization", "Bearer "+key.(string))))
	}
	for _, k := range []map[string]any{first, second, other} {
		if got, err := tenantOf(k["key"]); err != nil || got != k["tenant"] {
			t.Fatalf("key %s: tenant %q, %v; want %s", k["key_id"], got, err, k["tenant"])
		}
	}

	// ls never shows a secret.
	code, out, _ := run("ls")
	if code != ExitOK || !strings.Contains(out, first["key_id"].(string)) || !strings.Contains(out, "globex") {
		t.Fatalf("ls: exit %d:\n%s", code, out)
	}
	for _, k := range []map[string]any{first, second, other} {
		if strings.Contains(out, k["key"].(string)) {
			t.Fatal("ls printed a secret")
		}
	}

	// rotate-key revokes acme's two keys, not globex's.
	rotated := newKey("rotate-key", "acme")
	if rotated["revoked_keys"].(float64) != 2 {
		t.Errorf("rotate-key revoked %v keys, want 2", rotated["revoked_keys"])
	}
	for name, k := range map[string]map[string]any{"first": first, "second": second} {
		if _, err := tenantOf(k["key"]); err == nil {
			t.Errorf("acme's %s key still works after rotate-key", name)
		}
	}
	if got, err := tenantOf(rotated["key"]); err != nil || got != "acme" {
		t.Errorf("the rotated key: %q, %v", got, err)
	}
	if got, err := tenantOf(other["key"]); err != nil || got != "globex" {
		t.Errorf("globex's key after acme's rotation: %q, %v", got, err)
	}

	// revoke one key by id.
	if code, _, errs := run("revoke", other["key_id"].(string)); code != ExitOK {
		t.Fatalf("revoke: exit %d: %s", code, errs)
	}
	if _, err := tenantOf(other["key"]); err == nil {
		t.Error("globex's key still works after revoke")
	}
	code, out, _ = run("ls", "acme", "--json")
	var ls struct{ Keys []map[string]any }
	if code != ExitOK || json.Unmarshal([]byte(out), &ls) != nil || len(ls.Keys) != 3 {
		t.Fatalf("ls acme --json: exit %d: %s", code, out)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"frobnicate"}, "unknown subcommand"},
		{[]string{"create"}, "give one TENANT"},
		{[]string{"create", "a b"}, "tenant \"a b\""},
		{[]string{"revoke"}, "give one KEY_ID"},
		{[]string{"ls", "a", "b"}, "at most one TENANT"},
		{[]string{"revoke", "nosuchkey"}, "not found"},
	} {
		code, _, errs := run(tc.args...)
		if code == ExitOK || !strings.Contains(errs, tc.want) {
			t.Errorf("tenant %q: exit %d, stderr %q; want an error with %q", tc.args, code, errs, tc.want)
		}
	}
	var errb bytes.Buffer
	if code := Main(ctx, []string{"tenant"}, nil, &bytes.Buffer{}, &errb); code != ExitUsage || !strings.Contains(errb.String(), "give a subcommand") {
		t.Errorf("tenant alone: exit %d, %q", code, errb.String())
	}
	errb.Reset()
	// Without --store the command calls the admin API, and says so when no mesh answers.
	if code := Main(ctx, []string{"tenant", "ls", "--data-dir", t.TempDir(), "--addr", "127.0.0.1:1", "--insecure"}, nil, &bytes.Buffer{}, &errb); code != ExitFail ||
		!strings.Contains(errb.String(), "tenant ls: Unavailable") {
		t.Errorf("ls without a mesh: exit %d, %q", code, errb.String())
	}
	errb.Reset()
	if code := Main(ctx, []string{"tenant", "ls", "--scope", "admin", "--store", "x"}, nil, &bytes.Buffer{}, &errb); code != ExitUsage ||
		!strings.Contains(errb.String(), "--scope is for create") {
		t.Errorf("ls --scope: exit %d, %q", code, errb.String())
	}
	errb.Reset()
	if code := Main(ctx, []string{"tenant", "create", "acme", "--scope", "root"}, nil, &bytes.Buffer{}, &errb); code != ExitUsage ||
		!strings.Contains(errb.String(), "not a scope") {
		t.Errorf("create --scope root: exit %d, %q", code, errb.String())
	}
}
