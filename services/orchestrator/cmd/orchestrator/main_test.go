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
		{Name: "zero max runs", Args: []string{"--max-runs=0"}, Want: "--max-runs must be at least 1"},
		{Name: "negative run time from env", Env: map[string]string{"CURFEW_MIN_RUN_TIME": "-1s"}, Want: "--min-run-time"},
		{Name: "bad max runs from env", Env: map[string]string{"CURFEW_MAX_RUNS": "lots"}, Want: "CURFEW_MAX_RUNS"},
	}...)
	meshtest.RunFlagCases(t, "orchestrator", run, cases)
}
