// Command curfew starts the mesh on loopback and talks to its orchestrator. See the
// README's command reference, or run `curfew help`.
package main

import (
	"context"
	"os"

	"github.com/curfew-mesh/curfew/internal/cli"
)

func main() {
	os.Exit(cli.Main(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}
