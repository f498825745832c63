package bench

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// startMesh builds the binaries (once per test binary, or CURFEW_BIN_DIR) and starts the
// real mesh under `curfew up` with env added, stopping it when tb ends.
func startMesh(tb testing.TB, env ...string) *meshproc.Mesh {
	tb.Helper()
	return startMeshWith(tb, meshproc.Options{Env: env})
}

// startMeshWith is startMesh with all of meshproc's options (Insecure, say).
func startMeshWith(tb testing.TB, o meshproc.Options) *meshproc.Mesh {
	tb.Helper()
	dir, err := os.MkdirTemp("", "curfew-bench-")
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m, err := meshproc.Start(ctx, dir, o)
	if err != nil {
		_ = os.RemoveAll(dir)
		tb.Fatal("start mesh: ", err)
	}
	tb.Cleanup(func() {
		if err := m.Stop(); err != nil {
			tb.Log("curfew up did not stop cleanly: ", err)
		}
		if os.Getenv("CURFEW_BENCH_KEEP") == "" {
			_ = os.RemoveAll(dir)
		} else {
			tb.Log("mesh data and logs kept in ", dir)
		}
	})
	return m
}
