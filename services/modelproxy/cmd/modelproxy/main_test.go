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
		{Name: "negative decode time", Args: []string{"--min-decode-time=-1s"}, Want: "--min-decode-time must not be negative"},
		{Name: "negative decode time from env", Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "-5ms"}, Want: "--min-decode-time must not be negative"},
		{Name: "bad decode time from env", Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "fast"}, Want: "CURFEW_MIN_DECODE_TIME"},
		{Name: "flag wins over env", Args: []string{"--min-decode-time=-1s"}, Env: map[string]string{"CURFEW_MIN_DECODE_TIME": "fast"}, Want: "must not be negative"},
	}...)
	meshtest.RunFlagCases(t, "modelproxy", run, cases)
}
