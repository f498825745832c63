// Package migrations holds the versioned schema of the store, one SQL file per version
// and backend, embedded in the binary: sqlite/NNNN_name.sql and postgres/NNNN_name.sql.
//
// Rules for adding a migration (the next engineer's checklist):
//   - add the same version to both directories, numbered one past the last, never
//     renumbering or editing a released file (a database records the versions it ran);
//   - keep it additive where possible (new tables, new nullable or defaulted columns), so
//     that a binary one version older keeps working while replicas roll;
//   - one file runs in one transaction, together with its schema_migrations row, so a
//     failed migration leaves no trace.
//
// The runner (internal/sqlcore) applies the pending files at Open under a lock (an
// advisory lock on PostgreSQL, the write lock on SQLite), so replicas starting together
// migrate once; re-running is a no-op, and a database whose schema_migrations holds a
// version above [Latest] is refused with store.ErrSchemaTooNew.
package migrations

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
)

//go:embed sqlite/*.sql postgres/*.sql
var files embed.FS

// Migration is one schema version.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// For returns the migrations of a dialect ("sqlite" or "postgres") by ascending version.
func For(dialect string) ([]Migration, error) {
	entries, err := fs.ReadDir(files, dialect)
	if err != nil {
		return nil, fmt.Errorf("migrations: unknown dialect %q: %w", dialect, err)
	}
	var ms []Migration
	for _, e := range entries {
		name := e.Name()
		num, rest, ok := strings.Cut(strings.TrimSuffix(name, ".sql"), "_")
		if !ok {
			return nil, fmt.Errorf("migrations: %s/%s: want NNNN_name.sql", dialect, name)
		}
		v, err := strconv.Atoi(num)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("migrations: %s/%s: bad version %q", dialect, name, num)
		}
		b, err := files.ReadFile(dialect + "/" + name)
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: rest, SQL: string(b)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	for i, m := range ms {
		if m.Version != i+1 {
			return nil, fmt.Errorf("migrations: %s: version %d where %d was expected (gap or duplicate)", dialect, m.Version, i+1)
		}
	}
	return ms, nil
}

// Latest returns the highest version of a dialect.
func Latest(dialect string) (int, error) {
	ms, err := For(dialect)
	if err != nil {
		return 0, err
	}
	return len(ms), nil
}
