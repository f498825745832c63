package bench

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// report collects the benchmarks' tables; TestMain prints them after every benchmark has
// finished, so they never split a benchmark's result line (which benchstat parses).
var report struct {
	sync.Mutex
	strings.Builder
}

func addReport(s string) {
	report.Lock()
	defer report.Unlock()
	report.WriteString(s)
}

func TestMain(m *testing.M) {
	if os.Getenv(echoEnv) == "1" { // the child of BenchmarkLoopbackRTT
		os.Exit(echoServer())
	}
	if role := os.Getenv(bareRoleEnv); role != "" { // a process of the bare tree
		os.Exit(bareServe(role))
	}
	code := m.Run()
	meshproc.Cleanup() // the binaries Build made for this process (about 90 MB)
	cleanupToolBins()
	cleanupModelBin()
	report.Lock()
	if report.Len() > 0 {
		fmt.Print(report.String())
	}
	report.Unlock()
	os.Exit(code)
}
