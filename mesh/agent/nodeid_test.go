package agent

import "testing"

func TestModelStepIDs(t *testing.T) {
	if id := ModelStepID("root", 12); id != "root/m12" || !IsModelStepOf("root", id) {
		t.Fatalf("ModelStepID = %q, not a model step of root", id)
	}
	for id, want := range map[string]bool{"root/m0": true, "root/m12": true, "root": false, "root/m": false,
		"root/s0.t1": false, "root/s0.t1/m0": false, "root/m1x": false, "rootx/m0": false} {
		if IsModelStepOf("root", id) != want {
			t.Errorf("IsModelStepOf(root, %q) = %v", id, !want)
		}
	}
	if !IsModelStepOf("root/s0.t1/sub", "root/s0.t1/sub/m3") {
		t.Error("a subagent's own step is its loop's model step")
	}
}
