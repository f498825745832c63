package main

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Only invalid configurations are tested: a valid one would start serving.
func TestRunRejectsBadConfiguration(t *testing.T) {
	cases := append(meshtest.CommonFlagCases(), []meshtest.FlagCase{
		{Name: "negative spawn time", Args: []string{"--min-spawn-time=-1s"}, Want: "--min-spawn-time must not be negative"},
		{Name: "zero depth", Args: []string{"--max-depth=0"}, Want: "--max-depth must be at least 1"},
		{Name: "bad depth from env", Env: map[string]string{"CURFEW_MAX_DEPTH": "deep"}, Want: "CURFEW_MAX_DEPTH"},
	}...)
	meshtest.RunFlagCases(t, "subagent", run, cases)
}
