package e2e

import (
	"context"
	"os"
	"testing"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// newCluster returns a cluster of processes (meshproc.Cluster) on the store at dsn, in a
// directory of its own named after prefix. t.Cleanup stops its processes; the directory,
// with every process's log, is kept when the test fails, and its path logged.
func newCluster(ctx context.Context, t *testing.T, prefix, dsn string) *meshproc.Cluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "curfew-"+prefix+"-")
	if err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(ctx, dir, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if t.Failed() {
			t.Logf("process logs are in %s", dir)
		} else {
			_ = os.RemoveAll(dir)
		}
	})
	return c
}
