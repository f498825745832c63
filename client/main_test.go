package client_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// The real mesh the examples and tests drive, started once by TestMain: plaintext
// processes on loopback ports, a sqlite store, and an API key of tenant default.
var (
	// orchestratorAddr is the orchestrator's address.
	orchestratorAddr string
	// apiKey is an API key of tenant default.
	apiKey string
)

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "curfew-client-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	code := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		c, err := meshproc.NewCluster(ctx, dir, "sqlite://"+filepath.Join(dir, "curfew.db"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "start a cluster:", err)
			return 1
		}
		defer func() {
			if err := c.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "stop the cluster:", err)
			}
		}()
		model, sub, tools, err := c.Mesh(ctx, nil)
		if err != nil {
			fmt.Fprintln(os.Stderr, "start the mesh:", err)
			return 1
		}
		orch, err := c.Add(ctx, "orchestrator", "orchestrator", c.OrchestratorArgs(model, sub, tools)...)
		if err == nil {
			err = orch.Start(ctx)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "start the orchestrator:", err)
			return 1
		}
		orchestratorAddr, apiKey = orch.Addr, c.APIKey
		return m.Run()
	}()
	meshproc.Cleanup()
	if code != 0 {
		fmt.Fprintln(os.Stderr, "process logs are in", dir)
		return code
	}
	_ = os.RemoveAll(dir)
	if err := goleak.Find(); err != nil {
		fmt.Fprintln(os.Stderr, "goroutine leak:", err)
		return 1
	}
	return 0
}
