package meshproc_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// A port picked free can be taken before the service binds it (by any process's
// outgoing connection): the first start then picks another, instead of failing the test
// that asked for the process.
func TestStartPicksAgainAPortTakenMeanwhile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	c, err := meshproc.NewCluster(ctx, dir, "sqlite://"+filepath.Join(dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	}()
	p, err := c.Add(ctx, "subagent", "subagent")
	if err != nil {
		t.Fatal(err)
	}
	taken := p.AdminAddr
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", taken)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := p.Start(ctx); err != nil {
		t.Fatalf("start with its admin port taken: %v", err)
	}
	if p.AdminAddr == taken {
		t.Errorf("admin address still %s, the taken one", taken)
	}
}
