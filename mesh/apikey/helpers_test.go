package apikey_test

import (
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs (the benchmark)
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
)

// openStore opens the store at dsn (a new SQLite file when dsn is ""), closed when tb
// ends.
func openStore(tb testing.TB, dsn string) store.Store {
	tb.Helper()
	if dsn == "" {
		dsn = "sqlite://" + filepath.Join(tb.TempDir(), "keys.db")
	}
	st, err := store.Open(tb.Context(), dsn)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = st.Close() })
	return st
}

// makeKey makes a key of tenant and stores it (revoking the tenant's others when rotate).
func makeKey(tb testing.TB, st store.Store, tenant string, rotate bool) apikey.Key {
	tb.Helper()
	k, err := apikey.New(tenant)
	if err != nil {
		tb.Fatal(err)
	}
	if _, _, err := st.CreateAPIKey(tb.Context(), k.Record, rotate); err != nil {
		tb.Fatal(err)
	}
	return k
}
